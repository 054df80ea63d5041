"""Training prompts built from text every machine already has, disjoint from every evaluation.

The feature head (``specflow.models.feature_head``) learns from the target's own greedy
answers to chat prompts.  The prompts must not come from what the project evaluates on
(Spec-Bench, HumanEval), and no machine here reaches a dataset hub, so they are built from
two local sources and a small set of instruction templates, one per kind of task the
Spec-Bench categories ask for:

- Python's standard-library sources (``sysconfig``'s ``stdlib`` folder): functions and
  classes (code) and module docstrings (English prose);
- procedurally drawn arithmetic and word problems.

Templates (category: example)::

    coding:        "Explain what the following Python function does: ```python ...```"
                   "Write a Python function that <first docstring sentence>."
    summarization: "Summarize the following text in two or three sentences: <prose>"
    qa / rag:      "Read the text and answer: what is the module <m> used for? <prose>"
    translation:   "Translate into <language>: <one prose sentence>"
    writing:       "Write a short <form> about <topic>."
    math:          "What is 37 * 12 + 5? Show your steps."
    reasoning:     "If every <a> is a <b> and some <b> are <c>, ..."

Deterministic for a seed; ``LocalPrompt.source`` names the file (or template) each came from.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

FORMS = ("poem", "short story", "blog post introduction", "product description",
         "persuasive paragraph", "haiku", "formal email", "dialogue between two friends",
         "limerick", "speech opening", "travel diary entry", "news headline and lead")
TOPICS = ("the ocean at night", "a robot learning to paint", "remote work", "a lost key",
          "the history of bread", "autumn in a small town", "a chess tournament",
          "climate change", "the first day at a new school", "a lighthouse keeper",
          "electric bicycles", "a friendly dragon", "learning a new language", "coffee",
          "a time traveller's regret", "urban gardening", "the moon landing", "a rainy Monday",
          "teamwork", "an old library", "space tourism", "a street musician", "recycling",
          "a mountain hike", "artificial intelligence in medicine", "a family recipe",
          "the importance of sleep", "a city without cars", "honeybees", "winter solstice")
ROLES = ("a pirate captain", "a medieval knight", "a detective", "a tour guide in Rome",
         "a chef", "a sports commentator", "a wise old wizard", "a customer support agent",
         "an astronaut", "a museum curator")
LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Italian", "Portuguese")
THINGS = ("cats", "mammals", "birds", "pilots", "engineers", "artists", "squares",
          "rectangles", "roses", "flowers", "metals", "conductors", "students", "readers")


@dataclass(frozen=True)
class LocalPrompt:
    """One training prompt: an id, the task category, the user message and where it came from."""

    prompt_id: str
    category: str
    content: str
    source: str


def _stdlib_files(root: Path, rng: random.Random, limit: int) -> list[Path]:
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for p in root.glob("*/*.py")
                    if "test" not in p.parts[-2] and not p.name.startswith("_"))
    rng.shuffle(files)
    return files[:limit]


@functools.cache
def _pieces(path: Path) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(function/class sources, prose paragraphs, (function name, first docstring sentence));
    parsed once per file and process (a job draws its prompts again on a rerun)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return [], [], []
    lines = text.splitlines()
    code, prose, specs = [], [], []
    doc = ast.get_docstring(tree)
    if doc:
        for para in re.split(r"\n\s*\n", doc):
            para = " ".join(para.split())
            if 120 <= len(para) <= 900 and not para.startswith((">>>", "..")):
                prose.append(para)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            end = getattr(node, "end_lineno", None) or node.lineno
            n = end - node.lineno + 1
            if 4 <= n <= 40:
                code.append("\n".join(lines[node.lineno - 1 : end]))
            d = ast.get_docstring(node)
            if isinstance(node, ast.FunctionDef) and d:
                first = d.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].strip()
                if 20 <= len(first) <= 160 and not node.name.startswith("_"):
                    specs.append((node.name, first.rstrip(".")))
    return code, prose, specs


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 999)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What is {a} * {b} + {c}? Show your steps."
    if kind == 1:
        return f"Solve for x: {a}x + {b} = {c}. Explain each step."
    if kind == 2:
        return (f"A shop sells pens at ${a} each and notebooks at ${b} each. How much do "
                f"{c % 9 + 2} pens and {c % 7 + 1} notebooks cost together?")
    return f"What is {a}% of {c * 10}? Then add {b} to the result."


def _reasoning(rng: random.Random) -> str:
    x, y, z = rng.sample(THINGS, 3)
    kind = rng.randrange(3)
    if kind == 0:
        return (f"If every {x[:-1]} is a {y[:-1]} and some {y} are {z}, can we conclude that "
                f"some {x} are {z}? Explain your reasoning.")
    if kind == 1:
        n = rng.randint(3, 9)
        return (f"There are {n} people in a room and each shakes hands with every other person "
                "once. How many handshakes happen? Think step by step.")
    return (f"Anna is older than Ben, and Ben is older than Carl. Dana is younger than Carl. "
            f"Who is the {rng.choice(['oldest', 'youngest'])}? Explain.")


def local_prompts(num_prompts: int, seed: int = 0, stdlib: str | None = None,
                  max_chars: int = 1200) -> list[LocalPrompt]:
    """``num_prompts`` chat prompts drawn round-robin over the task categories (module doc)."""
    rng = random.Random(seed)
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    code: list[tuple[str, str]] = []
    prose: list[tuple[str, str]] = []
    specs: list[tuple[str, str, str]] = []
    for path in _stdlib_files(root, rng, limit=400):
        c, p, s = _pieces(path)
        rel = str(path.relative_to(root))
        code += [(rel, x) for x in c]
        prose += [(rel, x) for x in p]
        specs += [(rel, n, d) for n, d in s]
    rng.shuffle(code)
    rng.shuffle(prose)
    rng.shuffle(specs)
    if not code or not prose:
        raise RuntimeError(f"no Python sources with docstrings under {root}")
    out: list[LocalPrompt] = []
    categories = ("coding", "summarization", "qa", "translation", "writing", "roleplay",
                  "math", "reasoning", "code_write")
    for i in range(num_prompts):
        cat = categories[i % len(categories)]
        j = i // len(categories)
        if cat == "coding":
            src, body = code[j % len(code)]
            verb = rng.choice(["Explain what the following Python code does",
                               "Review this Python code and suggest improvements",
                               "Add comments to this Python code",
                               "Describe the inputs and outputs of this code"])
            content = f"{verb}:\n```python\n{body[:max_chars]}\n```"
        elif cat == "code_write":
            src, name, doc = specs[j % len(specs)]
            content = f"Write a Python function `{name}` that does the following: {doc}."
        elif cat in ("summarization", "qa"):
            src, text = prose[j % len(prose)]
            if cat == "summarization":
                content = f"Summarize the following text in two or three sentences:\n\n{text}"
            else:
                module = src.removesuffix(".py").replace("/", ".")
                content = (f"{text}\n\nBased on the text above, what is the Python module "
                           f"`{module}` used for, and when would you use it?")
        elif cat == "translation":
            src, text = prose[(j * 7 + 3) % len(prose)]
            sentence = text.split(". ")[0][:300]
            content = f"Translate the following sentence into {rng.choice(LANGUAGES)}: {sentence}"
        elif cat == "writing":
            src = "template:writing"
            content = f"Write a {rng.choice(FORMS)} about {rng.choice(TOPICS)}."
        elif cat == "roleplay":
            src = "template:roleplay"
            content = (f"Pretend you are {rng.choice(ROLES)}. Introduce yourself and tell me "
                       f"about {rng.choice(TOPICS)}.")
        elif cat == "math":
            src, content = "template:math", _math(rng)
        else:
            src, content = "template:reasoning", _reasoning(rng)
        out.append(LocalPrompt(f"local-{seed}-{i}", cat, content, src))
    return out
