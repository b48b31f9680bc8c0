"""A tiny released-style Qwen3.5 trained to answer one weather question with a tool call, so that
servers and commands can be tested on real XML tool calls (a random model never writes one).

    thinking on:  …<|im_start|>assistant\\n<think>\\n  ->  REASONING \\n</think>\\n\\n CALL <|im_end|>
    thinking off: …<think>\\n\\n</think>\\n\\n          ->  CALL <|im_end|>

Training a whole model on ~1,100-token sequences takes minutes on two cores, so only the head is
trained (STEPS of Adam, a second): the last block's MLP, the final norm and the LM head, on the
hidden states the frozen rest computes once (teacher forcing fixes them). The linear-attention layers get long memories
(small A_log: slow decay), so that positions whose last tokens agree, like the two
`<parameter=` with `city` and `days` after them, still differ in those hidden states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from qwen35_reference import make_qwen35, save_qwen35
from qwen35_tokenizer import COMPACT_VOCAB, write_qwen35_tokenizer

QUESTION = "What is the weather in Paris for the next 2 days?"
MESSAGES = [{"role": "user", "content": QUESTION}]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
REASONING = "The user wants the weather."
CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
ARGUMENTS = {"city": "Paris", "days": 2}  # days an integer: the schema says so
ANSWERS = {True: f"{REASONING}\n</think>\n\n{CALL}<|im_end|>", False: f"{CALL}<|im_end|>"}  # by enable_thinking
STEPS = 150
MIN_MARGIN = 2.0  # logits: the target token ahead of the runner-up by this much at every step


def hf_prompt_ids(hf_tokenizer: Any, thinking: bool) -> list[int]:
    """The weather question with TOOLS as transformers renders and tokenizes it."""
    text = hf_tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, enable_thinking=thinking, tokenize=False
    )
    return list(hf_tokenizer.encode(text, add_special_tokens=False))


def write_weather_model(path: Path, seed: int = 1) -> tuple[Path, Any]:
    """Train the model, check that greedy decoding gives ANSWERS in transformers, and save it in
    `path` as a released checkpoint (VLM wrapper, visual and mtp tensors) with the test tokenizer
    and Qwen3.5's chat template. Returns the path and the transformers model."""
    from transformers import AutoTokenizer

    write_qwen35_tokenizer(path, "3.5", compact=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    sequences = [
        (hf_prompt_ids(hf_tokenizer, thinking), hf_tokenizer.encode(answer, add_special_tokens=False))
        for thinking, answer in ANSWERS.items()
    ]
    with _one_thread():
        model = train_weather_model(sequences, seed)
        for prompt, answer in sequences:
            _check_greedy(model, prompt, answer)
    save_qwen35(model, path)
    write_qwen35_tokenizer(path, "3.5", compact=True)  # its generation_config.json, not transformers'
    return path, model


def train_weather_model(sequences: list[tuple[list[int], list[int]]], seed: int) -> Any:
    """A tiny Qwen3.5 whose last MLP, final norm and LM head learned each (prompt, answer) pair."""
    model = make_qwen35(seed=seed, vocab_size=COMPACT_VOCAB, intermediate_size=256)
    language_model = model.model.language_model
    last = language_model.layers[-1]
    with torch.no_grad():
        for layer in language_model.layers:
            if layer.block_type == "linear_attention":
                layer.linear_attn.A_log.uniform_(-4.0, -2.0)  # decay ~0.97 a token instead of ~0

    # The residual stream entering the last MLP, at the positions that predict the answer.
    captured: list[torch.Tensor] = []
    hook = last.post_attention_layernorm.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    with torch.no_grad():
        for prompt, answer in sequences:
            language_model(input_ids=torch.tensor([prompt + answer]))
    hook.remove()
    residual = torch.cat([h[0, len(p) - 1 : -1] for (p, _), h in zip(sequences, captured, strict=True)])
    targets = torch.tensor([t for _, answer in sequences for t in answer])

    trained = [last.post_attention_layernorm, last.mlp, language_model.norm, model.lm_head]
    model.requires_grad_(False)
    optimizer = torch.optim.Adam([p for m in trained for p in m.parameters()], lr=1e-2)
    for module in trained:
        module.requires_grad_(True)
    for _ in range(STEPS):
        hidden = residual + last.mlp(last.post_attention_layernorm(residual))
        loss = torch.nn.functional.cross_entropy(model.lm_head(language_model.norm(hidden)), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.requires_grad_(True).eval()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Ops this small gain nothing from a second thread, and lose several times over on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_greedy(model: Any, prompt: list[int], answer: list[int]) -> None:
    """Greedy decoding from `prompt` gives `answer`: with the answer fed (one forward), the argmax
    after each prefix is the answer's next token, by MIN_MARGIN."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    target = torch.tensor(answer)
    chosen = logits.gather(1, target[:, None])[:, 0]
    logits[torch.arange(len(answer)), target] = float("-inf")
    margin = float((chosen - logits.max(dim=1).values).min())
    assert margin > MIN_MARGIN, f"the trained model misses its answer (margin {margin:.2f}): train longer"
