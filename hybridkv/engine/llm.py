"""`LLM`: a model directory in, text out — tokenizer, chat template, engine and cache together."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hybridkv.cache.config import CacheConfig
from hybridkv.cached_model import CachedModel
from hybridkv.engine.chat_template import REASONING_FIELDS, ChatTemplate
from hybridkv.engine.disk_tier import open_disk_tier
from hybridkv.engine.engine import Engine, EngineConfig
from hybridkv.engine.request import Request, RequestOutput, StreamEvent
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.threads import IdleCores
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.models.gguf import GGUFFile, file_type_name
from hybridkv.models.sources import ResolvedModel, resolve_model
from hybridkv.models.weights import MemoryShare

log = logging.getLogger("hybridkv")
Prompt = str | Sequence[int]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_REMEMBERED = 256  # generated texts whose token ids are kept for re-encoding later chat turns


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def default_cache_config(engine: EngineConfig, **settings: Any) -> CacheConfig:
    """Room for the running sequences plus as many again kept for prefix reuse, and verify rows
    for every running sequence to speculate (`SpeculativeConfig.verify_rows`); `settings`
    override any field."""
    spec = engine.speculative
    defaults: dict[str, Any] = {
        "max_sequences": 2 * engine.max_num_seqs + 1,
        "snapshots_per_sequence": 16,
        "verify_rows": spec.verify_rows(engine.max_num_seqs),
    }
    return CacheConfig(**{**defaults, **settings})


def with_speculation(engine: EngineConfig, method: str | None, num_tokens: int | None) -> EngineConfig:
    """`engine` with `--speculative METHOD` / `--num-speculative-tokens K` applied (None: as it is)."""
    if method is None and num_tokens is None:
        return engine
    spec = engine.speculative
    return dataclasses.replace(
        engine,
        speculative=dataclasses.replace(
            spec,
            method=method if method is not None else spec.method,  # type: ignore[arg-type]  # validated by the config
            num_tokens=num_tokens if num_tokens is not None else spec.num_tokens,
        ),
    )


class LLM:
    """`LLM(model).generate(prompts, params)` and `.chat(messages, params)`.

    `model`: a checkpoint directory, a .gguf file, an ollama name or a Hugging Face repo id, found
    on this machine (`resolve_model`); with none, the default model. Requests run through the
    continuous-batching engine; a chat whose next turn extends the last one re-processes only the
    new tokens. `speculative` ("off", "ngram", "mtp", "auto") and `num_speculative_tokens` set
    speculative decoding (`engine.speculative`), overriding `engine.speculative`.
    """

    def __init__(
        self,
        model: str | Path | ResolvedModel | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        cache: CacheConfig | None = None,
        engine: EngineConfig | None = None,
        quantize: str | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        cache_dir: str | Path | None = None,
        cache_disk: int | None = None,
        memory: MemoryShare | None = None,
    ) -> None:
        """`cache_dir` / `cache_disk` (bytes; 0 off): the prefix cache's disk tier, off unless
        either is given (`open_disk_tier` says the defaults of the other). `close()` writes what
        is pending and stops it. `memory`: this process's share of the machine's memory when
        others load the same model (`CachedModel.load`)."""
        if model is None:
            from hybridkv.default_model import default_model_dir

            model = default_model_dir()
        self.source = model if isinstance(model, ResolvedModel) else resolve_model(model)
        for note in self.source.notes:
            log.warning("%s: %s", self.source.served_name, note)
        self.model_dir = self.source.path  # the checkpoint directory, or the (first) GGUF file
        engine = with_speculation(engine or EngineConfig(), speculative, num_speculative_tokens)
        cores = IdleCores() if engine.adapt_threads else None  # before the load: its first look covers it
        self.cm = CachedModel.load(
            self.source,
            parse_dtype(dtype),
            cache or default_cache_config(engine),
            quantize=quantize,
            mtp=_wants_mtp(engine, self.source),
            memory=memory,
        )
        self.files: tuple[Path, ...]  # what the model was read from
        generation_config: dict[str, Any] = {}
        if self.source.is_gguf:  # tokenizer and chat template from the file's metadata
            with GGUFFile(self.model_dir) as gguf:
                metadata = gguf.metadata
            self.tokenizer = Tokenizer.from_gguf_metadata(metadata)
            self.template = ChatTemplate.from_gguf_metadata(metadata)
            self.files = tuple(self.source.gguf_parts)
            self.file_format, self.architecture = "gguf", str(metadata.get("general.architecture", "unknown"))
            self.quantization = quantize.upper() if quantize else file_type_name(metadata)
        else:
            self.tokenizer = Tokenizer.from_dir(self.model_dir)
            self.template = ChatTemplate.from_dir(self.model_dir)
            generation_config = _read_json(self.model_dir / "generation_config.json")
            self.files = tuple(sorted(p for p in self.model_dir.iterdir() if p.is_file()))
            model_type = _read_json(self.model_dir / "config.json").get("model_type", "unknown")
            self.file_format, self.architecture = "safetensors", str(model_type)
            dtype_name = {torch.float32: "F32", torch.bfloat16: "BF16"}.get(self.cm.dtype, str(self.cm.dtype))
            self.quantization = quantize.upper() if quantize else dtype_name
        self.generation_config = {**generation_config, **self.source.sampling_defaults}  # ollama's params layer
        disk = open_disk_tier(self.source, self.cm, quantize, cache_dir, cache_disk)
        self.engine = Engine(self.cm, self.tokenizer, engine, self.generation_config, cores, disk)
        self._generated: OrderedDict[str, list[int]] = OrderedDict()

    def close(self) -> None:
        """Cancel what runs, write what the disk tier still has queued, stop the engine."""
        self.engine.shutdown()

    # -- prompts ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and the positions where its messages end.

        Each message is tokenized on its own, so a conversation that extends another encodes
        to an extension of its ids; an assistant message this LLM generated is encoded to the
        very ids it generated (re-tokenizing text can differ), keeping the cache hit exact.
        """
        if self.template is None:
            raise ValueError(f"{self.model_dir} has no chat template (tokenizer_config.json chat_template)")
        text = self.template.render(messages, add_generation_prompt, tools, **template_kwargs)
        ends = self.template.message_boundaries(messages, add_generation_prompt, tools, **template_kwargs)
        answers = [
            text
            for m in messages
            if m.get("role") == "assistant"
            for text in (m.get("content"), *(m.get(name) for name in REASONING_FIELDS))
            if isinstance(text, str) and text
        ]
        ids: list[int] = []
        hints: list[int] = []
        start = 0
        for end in [*ends, len(text)]:
            if end > start:
                ids += self._encode_segment(text[start:end], answers)
                hints.append(len(ids) - 1)
            start = end
        return ids, hints

    def _encode_segment(self, segment: str, answers: list[str]) -> list[int]:
        """Tokenize one message's rendered text; a text this LLM generated for one of the assistant
        `answers` is encoded to the ids it generated. The template may render the answer in pieces
        (Qwen3.6 with preserve_thinking rebuilds "<think>" + reasoning + "</think>" + content),
        so the generated text is looked for in the segment, newest first."""
        disk = self.engine.disk
        if disk is not None:  # answers generated before a restart
            for answer in answers:
                if answer not in self._generated and (saved := disk.load_answer(answer)) is not None:
                    self._generated[answer] = saved
        if answers:
            for generated, generated_ids in reversed(self._generated.items()):
                if generated in segment and any(answer in generated for answer in answers):
                    before, _, after = segment.partition(generated)
                    return self.tokenizer.encode(before) + generated_ids + self.tokenizer.encode(after)
        return self.tokenizer.encode(segment)

    def remember(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            ids = list(completion.token_ids)
            if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
                ids = ids[:-1]  # the stop token's text is not part of the answer
            elif completion.finish_reason not in ("length", "cancelled") or completion.stop_reason is not None:
                continue  # cut at a stop string: its text and ids no longer line up
            if completion.text:
                self._generated[completion.text] = ids
                self._generated.move_to_end(completion.text)
                if self.engine.disk is not None:
                    self.engine.disk.save_answer(completion.text, ids)
        while len(self._generated) > _REMEMBERED:
            self._generated.popitem(last=False)

    # -- generation ---------------------------------------------------------------------------

    def submit(
        self, prompt_ids: list[int], params: SamplingParams | None = None, cache_hint: Sequence[int] = ()
    ) -> Request:
        return self.engine.add_request(self.engine.make_request(prompt_ids, params, tuple(cache_hint)))

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); all run together in the engine's batches."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        requests = [self.engine.make_request(self.encode(p), params) for p in batch]
        return self._run(requests)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> RequestOutput:
        ids, hints = self.encode_chat(messages, tools, **template_kwargs)
        request = self.engine.make_request(ids, params, tuple(hints))
        return self._run([request])[0]

    def stream(
        self, prompt_ids: list[int], params: SamplingParams | None = None, cache_hint: Sequence[int] = ()
    ) -> Iterator[StreamEvent]:
        """Events of one request as they happen (drives the engine in this thread)."""
        request = self.engine.add_request(self.engine.make_request(prompt_ids, params, tuple(cache_hint)))
        while True:
            while not request.events.empty():
                event = request.events.get()
                yield event
                if event.done:
                    self.remember(request.output())
                    return
            self.engine.step()

    def _run(self, requests: list[Request]) -> list[RequestOutput]:
        for request in requests:
            self.engine.add_request(request)
        self.engine.run_until_done()
        outputs = [r.output() for r in requests]
        for output in outputs:
            self.remember(output)
        return outputs


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _wants_mtp(engine: EngineConfig, source: ResolvedModel) -> bool:
    """Load the MTP block for `--speculative mtp` (`auto` drafts by prompt lookup)."""
    return engine.speculative.method == "mtp" and not source.is_gguf
