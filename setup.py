"""Package setup: every value comes from settings.ini (nbdev 2 layout)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]


def reqs(key):
    """Space-separated requirement list from settings.ini."""
    return cfg.get(key, "").split()


licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
lic = licenses[cfg["license"]]
readme = here / "README.md"

setuptools.setup(
    name=cfg["lib_name"].replace("_", "-"),
    version=cfg["version"],
    description=cfg["description"],
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else "",
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    url=cfg["git_url"],
    license=lic[0],
    keywords=cfg["keywords"].split(),
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"]) - 1],
        "Intended Audience :: " + cfg["audience"].title(),
        "License :: " + lic[1],
        "Natural Language :: " + cfg["language"].title(),
        "Programming Language :: Python :: 3",
    ],
    packages=setuptools.find_packages(include=[cfg["lib_name"], cfg["lib_name"] + ".*"]),
    include_package_data=True,
    python_requires=">=" + cfg["min_python"],
    install_requires=reqs("requirements"),
    extras_require={
        "train": reqs("train_requirements"),
        "dev": reqs("dev_requirements"),
        "bench": reqs("bench_requirements"),
        "ray": reqs("ray_requirements"),
        "cloud": reqs("cloud_requirements"),
    },
    entry_points={"console_scripts": cfg["console_scripts"].split()},
    zip_safe=False,
)
