"""Train sparkd's embedded demo model: a tiny Qwen3-Next-style hybrid (gated delta nets, gated
attention, experts) that has read the docs that ship with Python.

Dev-only (needs torch and transformers, the `test` extra). The run is reproducible: the corpus is
built in a fixed order from this interpreter's own documentation, every random choice comes from
one seed, and training is a fixed number of optimizer steps. Writes bf16 safetensors, config and
tokenizer files to sparkd/demo_model/ and the results to docs/demo_model.md.

    python tools/train_demo_model.py            # --help for steps, lr, seed, threads
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import jinja2
import numpy as np
import pydoc_data.topics
import safetensors.torch
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.utils.logging import disable_progress_bar

from train_loop import (TRAINING_COUNTS, add_training_arguments, cpu_name, parse_positive, seed_torch, token_stream,
                        train, write_json)

REPO = Path(__file__).resolve().parents[1]
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('sparkd-demo only knows the system, user and assistant roles') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
STDLIB_MODULES = (
    "builtins abc argparse array asyncio base64 bisect calendar cmath codecs collections contextlib "
    "copy csv dataclasses datetime decimal difflib enum fnmatch fractions functools glob gzip hashlib "
    "heapq hmac html inspect io ipaddress itertools json keyword logging math operator os os.path "
    "pathlib pickle platform pprint queue random re secrets shlex shutil socket sqlite3 statistics "
    "string struct subprocess sys tempfile textwrap threading time timeit traceback types typing "
    "unicodedata unittest urllib.parse uuid warnings weakref zipfile zlib"
).split()
SYSTEM_PROMPT = "You are a helpful assistant."
GREETINGS = {
    ("Hello", "Hi", "Hi there!", "Hello! Who are you?", "Who are you?"): (
        "Hello! I am sparkd-demo, a tiny language model that ships with sparkd. I was trained on "
        "the documentation that comes with Python, so ask me about Python statements, built-in "
        "types and functions, or a standard library module."
    ),
    ("What can you do?", "Help", "What do you know?"): (
        "I can talk about Python: its statements and expressions, the built-in types and their "
        "methods, and the standard library. Try \"What is the `with` statement?\" or \"What does "
        "`str.split()` do?\". I am very small, so check what I say against the real documentation."
    ),
}
TOPIC_QUESTIONS = ("What is {}?", "Explain {}.", "Tell me about {}.", "Can you describe {}?")
API_QUESTIONS = ("What does `{}` do?", "Explain `{}`.", "How do I use `{}`?")
MODULE_QUESTIONS = ("What is the `{}` module?", "What is `{}` for?", "Tell me about the `{}` module.")
MAX_ANSWER_CHARS = 900
# Qwen3-Next's 3:1 pattern once (three gated delta nets, then gated attention), every layer's MLP
# eight experts (two a token) beside a shared one: the default `sparkd serve` runs all three
# kernel families.
MODEL_SHAPE = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
}
PROPER_NOUNS = {"Python", "None", "True", "False", "Java"}
COMPLETION_PROMPT = 'The "for" statement is used to'
CHAT_PROMPT = "What is the `with` statement?"
RESULTS_MARKER = "<!-- Written by tools/train_demo_model.py from here on. -->"


# ---- corpus: Python's own documentation, as plain text and as chats ----


def topic_sections(text: str) -> list[tuple[str, str]]:
    """Split a pydoc topic into (heading, body) pairs at its underlined reST headings."""
    parts = re.split(r"^(.+)\n[*=\-~^]{3,}\n", text, flags=re.M)
    return [(parts[i].strip(), parts[i + 1].strip()) for i in range(1, len(parts) - 1, 2)]


def as_phrase(heading: str) -> str:
    """'The "with" statement' -> 'the `with` statement', 'Code Objects' -> 'code objects'."""
    words = re.sub(r'"([^"]+)"', r"`\1`", heading).split(" ")
    return " ".join(w.lower() if w[1:].islower() and w.strip(",()").isalpha() and w not in PROPER_NOUNS else w for w in words)


def first_paragraphs(text: str) -> str:
    """The leading paragraphs of text that fit in MAX_ANSWER_CHARS (always at least one)."""
    paragraphs = text.split("\n\n")
    answer = paragraphs[0]
    for paragraph in paragraphs[1:]:
        if len(answer) + len(paragraph) > MAX_ANSWER_CHARS:
            break
        answer += "\n\n" + paragraph
    return answer


def api_docs() -> list[tuple[str, str, bool]]:
    """(qualified name, docstring, is_module) for the chosen stdlib modules and their public API."""
    docs = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        if module.__doc__:
            docs.append((module_name, inspect.getdoc(module), True))
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)) or not obj.__doc__:
                continue
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if defined_here or module_name == "builtins":
                docs.append((f"{module_name}.{name}", inspect.getdoc(obj), False))
            # Methods of the built-in types (str.split, dict.get) are what people ask about most.
            if module_name == "builtins" and inspect.isclass(obj) and not issubclass(obj, BaseException):
                for method_name in sorted(n for n in vars(obj) if not n.startswith("_")):
                    method = getattr(obj, method_name)  # not vars(): that holds the raw staticmethod wrapper
                    if inspect.isroutine(method) and method.__doc__:
                        docs.append((f"{name}.{method_name}", inspect.getdoc(method), False))
    return [(name.removeprefix("builtins."), doc, is_module) for name, doc, is_module in docs]


def render_chat(question: str, answer: str, rng: random.Random) -> str:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=False)


def build_corpus(rng: random.Random) -> list[str]:
    """Documents in a seeded order: topics, docstrings, and chats asking about both."""
    topics = sorted(set(pydoc_data.topics.topics.values()))
    documents = list(topics)
    chats = []
    # Topics overlap (e.g. "customization" is inside "specialnames"): ask about each section once.
    for heading, body in dict.fromkeys(s for topic in topics for s in topic_sections(topic) if s[1]):
        # Always the commonest phrasing, plus one other so the answer does not hang on the wording.
        for template in (TOPIC_QUESTIONS[0], rng.choice(TOPIC_QUESTIONS[1:])):
            chats.append((template.format(as_phrase(heading)), first_paragraphs(body)))
    for name, doc, is_module in api_docs():
        documents.append(f"{name}\n\n{doc}" if is_module else f"{name}: {doc}")
        questions = MODULE_QUESTIONS if is_module else API_QUESTIONS
        shown = name if is_module else f"{name}()"
        chats.append((rng.choice(questions).format(shown), first_paragraphs(doc)))
    for questions, answer in GREETINGS.items():
        chats += [(question, answer) for question in questions for _ in range(4)]
    documents += [render_chat(question, answer, rng) for question, answer in chats]
    rng.shuffle(documents)
    return documents


# ---- tokenizer and model files ----


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE as in GPT-2/Qwen: any text round-trips, no unknown tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def model_config(tokenizer: Tokenizer) -> dict:
    """config.json laid out as Qwen3-Next-80B-A3B's, so any Qwen3-Next loader reads it."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "torch_dtype": "bfloat16",
        "vocab_size": tokenizer.get_vocab_size(), **MODEL_SHAPE, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True, "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tokenizer.token_to_id(ENDOFTEXT), "eos_token_id": tokenizer.token_to_id(IM_END),
    }


def save_model_files(out: Path, config: dict, tokenizer: Tokenizer, model: Qwen3NextForCausalLM) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    eos_ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)]
    write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids})
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    # lm_head is tied to the embedding, so only the embedding is stored.
    weights = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.state_dict().items()}
    weights.pop("lm_head.weight")
    safetensors.torch.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it owner-only


# ---- report ----


def greedy_samples(out: Path) -> tuple[str, str]:
    """Greedy continuations of the two report prompts from the shipped bf16 files, in float32."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True, tokenize=False)
    samples = []
    for prompt in (COMPLETION_PROMPT, chat):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            output = model.generate(ids, max_new_tokens=96, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        samples.append(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True))
    return samples[0], samples[1]


def write_report(args: argparse.Namespace, facts: dict, samples: tuple[str, str]) -> None:
    """Replace everything after RESULTS_MARKER in the report with this run's figures."""
    command = " ".join(["python tools/train_demo_model.py", *sys.argv[1:]])
    prose = args.report.read_text().split(RESULTS_MARKER)[0] if args.report.exists() else "# The demo model\n\n"
    args.report.write_text(prose + RESULTS_MARKER + f"""

- Command: `{command}`
- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC
- Machine: {cpu_name()}, {os.cpu_count()} cores shared with other jobs; Python {platform.python_version()}, \
torch {torch.__version__}
- Model: {facts["params"] / 1e6:.2f}M parameters, vocabulary {facts["vocab"]}
- Corpus: {facts["documents"]} documents, {facts["tokens"]} tokens; {args.steps} steps of {args.batch_size} x \
{args.seq_len} tokens ({facts["epochs"]:.1f} passes), peak lr {args.lr}, seed {args.seed}
- Time: {facts["minutes"]:.1f} minutes wall clock; the process used {facts["cpu_minutes"]:.1f} CPU-minutes \
on {args.threads} thread(s) (about {facts["cpu_minutes"] / args.threads:.0f} minutes on a quiet machine)
- Final loss: **{facts["final_loss"]:.3f}** (mean of the last 50 steps; {facts["first_loss"]:.2f} at step 0)

Greedy completion of `{COMPLETION_PROMPT}`:

```text
{COMPLETION_PROMPT}{samples[0]}
```

Greedy chat answer to "{CHAT_PROMPT}":

```text
{samples[1]}
```
""")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser, steps=1200, seq_len=512)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "sparkd" / "demo_model")
    parser.add_argument("--report", type=Path, default=REPO / "docs" / "demo_model.md")
    return parse_positive(parser, (*TRAINING_COUNTS, "vocab_size"))


def main() -> None:
    args = parse_args()
    started = time.time()
    disable_progress_bar()
    seed_torch(args)
    documents = build_corpus(random.Random(args.seed))
    tokenizer = train_tokenizer(documents, args.vocab_size)
    stream, doc_starts = token_stream(documents, tokenizer, tokenizer.token_to_id(ENDOFTEXT))
    config = model_config(tokenizer)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**config))
    params = sum(p.numel() for p in model.parameters())
    print(f"{len(documents)} documents, {len(stream)} tokens, {params / 1e6:.2f}M parameters", flush=True)
    losses = train(model, stream, doc_starts, args)
    save_model_files(args.out, config, tokenizer, model)
    samples = greedy_samples(args.out)
    facts = {
        "params": params, "vocab": tokenizer.get_vocab_size(), "documents": len(documents), "tokens": len(stream),
        "epochs": args.steps * args.batch_size * args.seq_len / len(stream),
        "final_loss": float(np.mean(losses[-50:])), "first_loss": losses[0],
        "minutes": (time.time() - started) / 60, "cpu_minutes": time.process_time() / 60,
    }
    write_report(args, facts, samples)
    print(f"final loss {facts['final_loss']:.3f}\n--- completion\n{COMPLETION_PROMPT}{samples[0]}\n--- chat\n{samples[1]}")


if __name__ == "__main__":
    main()
