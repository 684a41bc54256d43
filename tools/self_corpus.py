"""Generate a corpus of the default model's own answers, for a frozen table of its habits.

A frozen table built from code (the shipped one: the Python standard library) knows code; it does
not know how the chat model phrases an answer ("Here are some", "**Step 1:**", "I hope this
helps"). This asks the model itself: questions made from templates x topics (and, in a second
round, summaries and questions about its own first-round answers), greedy, batched with mlx-lm's
batch_generate (~85 tokens/s on a 2-core CPU at 32 a batch). None of the prompts come from the
benchmark data in ../shared/data (the test set).

With --qa, short factual and how-to questions about people, places and the topics, then a
follow-up turn ("Can you make that shorter?") in a third of those chats, as a conversation's
second turn asks. With --code, the prompts are instead the heads of functions of the Python standard library (the
`def` line and its docstring), completed as raw text, without the chat template: how the model
writes a function body when it continues code, as in an editor or a completion benchmark.

    .venv/bin/python -m tools.self_corpus OUT.jsonl [--prompts 480] [--max-tokens 192] [--batch 32]
    .venv/bin/python -m tools.self_corpus OUT.jsonl --code [--prompts 640] [--max-tokens 128]
    .venv/bin/python -m tools.self_corpus OUT.jsonl --qa [--prompts 480]

Each line of OUT.jsonl: {"text": the answer, "prompt": ...}; the table builder reads "text".
"""

import argparse
import ast
import json
import random
import textwrap
import time
from pathlib import Path

import cacheback_mlx  # noqa: F401  (OpenBLAS before mlx)
from cacheback_mlx.loader import load

from mlx_lm.generate import batch_generate

TOPICS = """the ocean; honey bees; the printing press; volcanoes; a small bakery; electric cars; the moon landing;
photosynthesis; a rainy city; the Roman empire; climate change; a lost dog; public libraries; jazz music;
the human heart; social media; a mountain village; recycling; the stock market; desert plants; black holes;
a first job interview; remote work; the French revolution; vaccines; a school garden; chess; coral reefs;
a long train journey; the internet; ancient Egypt; sleep; a family dinner; renewable energy; bicycles;
the water cycle; a museum at night; friendship; earthquakes; artificial intelligence; coffee; a marathon;
the immune system; a thunderstorm; medieval castles; time management; the solar system; a farmers market;
online privacy; the Great Wall of China; learning a language; a startup company; rain forests; democracy;
a birthday party; the Industrial Revolution; smartphones; a haunted house; healthy eating; glaciers;
a football match; the piano; migration of birds; cloud computing; a city park; inflation; the Renaissance;
a camping trip; DNA; a new neighbour; space travel; the post office; a snowy winter; video games; tea;
a job promotion; the Olympic games; pollution; a lighthouse keeper; volunteering; the Silk Road""".replace("\n", " ")

TEMPLATES = [
    "Write a short story about {t}.",
    "Write a blog post about {t}.",
    "Write a poem about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Give me five tips related to {t}.",
    "Describe {t} in three paragraphs.",
    "Pretend you are a tour guide and talk about {t}.",
    "Act as a teacher and give a short lesson on {t}.",
    "What are the most important facts about {t}?",
    "Write an email to a friend about {t}.",
    "Compare {t} and {u}.",
    "What is the history of {t}?",
    "Why is {t} important? Answer in a few sentences.",
    "List some common questions people ask about {t}, with answers.",
    "Write a persuasive essay about {t}.",
    "Summarize what you know about {t} in one paragraph.",
    "How would you explain {t} to someone from the year 1800?",
    "Give a step-by-step plan for a project about {t}.",
    "Write a dialogue between two people discussing {t}.",
]

CODE = [
    "Write a Python function that {c}.",
    "Write a Python function that {c}. Include a docstring and an example.",
    "How do I {c} in Python? Show the code and explain it.",
]
CODE_TASKS = """reverses a string; counts the vowels in a string; checks whether a number is prime; returns the n-th
Fibonacci number; merges two sorted lists; removes duplicates from a list while keeping order; finds the
largest element of a list; computes the factorial of a number; checks whether a word is a palindrome;
sorts a list of dictionaries by a key; reads a text file and counts its words; converts Celsius to
Fahrenheit; flattens a nested list; finds the most common element in a list; checks whether two strings
are anagrams; computes the average of a list of numbers; splits a list into chunks of size n; returns
the prime factors of a number; validates an email address; transposes a matrix""".replace("\n", " ")

MATH = [
    "{a} has {x} apples. She buys {y} more and gives {z} to her friend. How many apples does she have now?",
    "A train travels {x} miles in {y} hours. What is its average speed?",
    "A shop sells pens for ${y} each. {a} buys {x} pens and pays with a ${w} bill. How much change does he get?",
    "{a} saves ${x} every week. How many weeks does it take to save ${w}?",
    "A rectangle is {x} cm long and {y} cm wide. What are its area and perimeter?",
    "There are {x} students in a class. {z} of them are absent. What percentage of the class is present?",
]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "John"]

SECOND = [
    "Summarize the following text in two sentences.\n\n{a}",
    "Read the text below and answer: what is its main point?\n\n{a}",
    "Rewrite the following text in a more formal style.\n\n{a}",
    "Extract the key facts from this text as a bulleted list.\n\n{a}",
]


# --qa: short factual questions and how-to questions, then a follow-up turn in the same chat
PEOPLE = """Albert Einstein; Marie Curie; William Shakespeare; Leonardo da Vinci; Isaac Newton; Nelson Mandela;
Ada Lovelace; Charles Darwin; Cleopatra; Mahatma Gandhi; Wolfgang Amadeus Mozart; Frida Kahlo; Alan Turing;
Napoleon Bonaparte; Jane Austen; Galileo Galilei; Martin Luther King Jr.; Nikola Tesla; Abraham Lincoln;
Confucius; Florence Nightingale; Pablo Picasso; Queen Victoria; Ludwig van Beethoven""".replace("\n", " ")
PLACES = """Japan; Brazil; Canada; Egypt; Australia; Norway; Kenya; Mexico; India; Italy; Peru; Iceland;
the Sahara; the Amazon river; Mount Everest; the Pacific Ocean; Antarctica; the Alps; New York City; Paris;
Tokyo; the Nile; the Mediterranean Sea; Siberia""".replace("\n", " ")
QA = [
    "Who was {p}?", "What is {p} best known for?", "When was {p} born, and where?",
    "What is the capital of {l}?", "Where is {l}, and what is it known for?", "What language is spoken in {l}?",
    "What is the population of {l}?", "How big is {l}?", "What is {t}?",
    "When did {t} begin?", "How does {t} work?", "What is the difference between {t} and {u}?",
    "How do I get started with {t}?", "What should I know before learning about {t}?",
    "Is {t} good or bad? Give a balanced answer.", "Name three interesting facts about {l}.",
    "What did {p} discover or create?", "Why is {p} famous?", "What are the main causes of {t}?",
]
FOLLOW_UPS = [
    "Can you make that shorter?", "Can you give me an example?", "Now explain it to a child.",
    "Summarize your answer in one sentence.", "Can you put that in a table?", "Why is that?",
    "Rewrite your answer as a bulleted list.", "What else should I know?", "Tell me more about the first point.",
    "Can you write it in a more formal tone?",
]


def qa_round(n: int, rng: random.Random) -> list[str]:
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    people = [t.strip() for t in PEOPLE.split(";") if t.strip()]
    places = [t.strip() for t in PLACES.split(";") if t.strip()]
    out = []
    while len(out) < n:
        t, u = rng.sample(topics, 2)
        out.append(rng.choice(QA).format(t=t, u=u, p=rng.choice(people), l=rng.choice(places)))
    return out


def first_round(n: int, rng: random.Random) -> list[str]:
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    tasks = [t.strip() for t in CODE_TASKS.split(";") if t.strip()]
    out = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.7:
            t, u = rng.sample(topics, 2)
            out.append(rng.choice(TEMPLATES).format(t=t, u=u))
        elif kind < 0.85:
            out.append(rng.choice(CODE).format(c=rng.choice(tasks)))
        else:
            x, y, z = rng.randint(12, 90), rng.randint(2, 12), rng.randint(1, 11)
            out.append(rng.choice(MATH).format(a=rng.choice(NAMES), x=x, y=y, z=z, w=x * y + rng.randint(1, 50)))
    return out


def function_heads(n: int, rng: random.Random, max_chars: int = 1200) -> list[str]:
    """n heads of documented standard-library functions: the def line(s) and the docstring,
    dedented, as a file would hold them (the table's own corpus, so nothing new is learned from
    the code itself, only how the model goes on from it)."""
    from .build_default_table import stdlib_files

    heads = []
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) \
                    and len(node.body) > 1 and not node.decorator_list:
                text = textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].end_lineno]))
                if 40 < len(text) <= max_chars:
                    heads.append(text)
    return rng.sample(heads, min(n, len(heads)))


def generate(lm, prompts: list, max_tokens: int, batch: int, chat: bool = True) -> list[str]:
    """Greedy answers; a prompt is a user message, a list of chat messages, or raw text (chat=False)."""
    tok = lm.tokenizer
    answers = []
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        ids = [tok.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str) else p,
                                       add_generation_prompt=True) if chat else tok.encode(p) for p in part]
        t0 = time.perf_counter()
        answers += batch_generate(lm.model, tok, ids, max_tokens=max_tokens).texts
        print(f"{i + len(part)}/{len(prompts)} prompts, {time.perf_counter() - t0:.0f} s", flush=True)
    return answers


def save(out: str, prompts: list, answers: list[str]) -> None:
    with Path(out).open("w") as f:
        for p, x in zip(prompts, answers):
            f.write(json.dumps({"text": x, "prompt": p}) + "\n")
    print(f"{len(answers)} answers -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=480, help="first-round prompts (a third more in round two)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--code", action="store_true", help="raw completions of standard-library function heads")
    ap.add_argument("--qa", action="store_true", help="factual and how-to questions, then a follow-up turn")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    lm = load()
    if a.code:
        prompts = function_heads(a.prompts, rng)
        answers = generate(lm, prompts, a.max_tokens, a.batch, chat=False)
        return save(a.out, prompts, answers)
    if a.qa:
        prompts = qa_round(a.prompts, rng)
        answers = generate(lm, prompts, a.max_tokens, a.batch)
        chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": x},
                  {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
                 for q, x in rng.sample(list(zip(prompts, answers)), a.prompts // 3)]
        answers += generate(lm, chats, a.max_tokens, a.batch)
        return save(a.out, prompts + chats, answers)
    prompts = first_round(a.prompts, rng)
    answers = generate(lm, prompts, a.max_tokens, a.batch)
    texts = [x for x in answers if len(x) > 200]
    second = [rng.choice(SECOND).format(a=x) for x in rng.sample(texts, min(len(texts), a.prompts // 3))]
    prompts += second
    answers += generate(lm, second, a.max_tokens, a.batch)
    save(a.out, prompts, answers)


if __name__ == "__main__":
    main()
