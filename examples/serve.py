"""Continuous batching on a paged KV cache, serving the model examples/train_lm.py trains.

Requests (prompts cut from the standard library's .py files, of different lengths,
each wanting a different number of new bytes) arrive over time. A fixed number of
batch slots decode together, one token each per step (`omni_jax.paged_attention`);
a request that gets a slot prefills its prompt into pages taken from a shared pool,
takes one more page whenever its sequence crosses into a new one, and gives them all
back when it finishes, freeing its slot for the next waiting request.

    python examples/train_lm.py                        # writes train_lm_out/checkpoint.npz
    python examples/serve.py                           # CPU: a few seconds
    python examples/serve.py --implementation triton   # the Triton kernel, on a GPU

Prints each request's text and the output tokens per second (compilation excluded).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lm  # noqa: E402 (the model and its checkpoint format live there)

Array = Any


def load_model(path: Path, dtype: Any, implementation: str | None) -> train_lm.LanguageModel:
    """The checkpoint's model, its sizes read from the saved parameter shapes."""
    with np.load(path) as saved:
        query = saved["model/blocks/0/attention/query/kernel"]  # [d_model, heads, head_dim]
        config = SimpleNamespace(
            d_model=query.shape[0], heads=query.shape[1],
            kv_heads=saved["model/blocks/0/attention/key/kernel"].shape[1],
            layers=len({name.split("/")[2] for name in saved.files
                        if name.startswith("model/blocks/")}),
            implementation=implementation, dtype=jnp.dtype(dtype),
            context_parallel=1)  # serving keeps each sequence on one device
        model = train_lm.LanguageModel(config, nnx.Rngs(0))
        train_lm.load_state(saved, "model", model, nnx.Param, path)
    return model


class PagePool:
    """The cache's pages not held by any request."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, -1, -1))

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("the page pool is exhausted: pass a larger --num-pages")
        return self.free.pop()

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


@dataclasses.dataclass
class Request:
    number: int
    prompt: bytes
    max_new: int
    arrival_step: int
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)


def make_requests(count: int, prompt_lengths: tuple[int, int], new_tokens: tuple[int, int],
                  arrivals_per_step: float, rng: np.random.Generator) -> list[Request]:
    """Prompts cut from stdlib sources; arrivals a Poisson process of the given rate."""
    source = b"".join(path.read_bytes() for path in train_lm.stdlib_files()[:40])
    arrival = np.cumsum(rng.poisson(1 / arrivals_per_step, count))
    requests = []
    for number in range(count):
        length = int(rng.integers(prompt_lengths[0], prompt_lengths[1] + 1))
        start = int(rng.integers(0, len(source) - length))
        requests.append(Request(number, source[start:start + length],
                                int(rng.integers(new_tokens[0], new_tokens[1] + 1)),
                                int(arrival[number])))
    return requests


@functools.partial(nnx.jit, donate_argnums=(2,))
def forward(model: train_lm.LanguageModel, tokens: Array, pages: list, page_table: Array,
            kv_lens: Array) -> tuple[Array, list]:
    """Logits of ``tokens [batch, n]`` after each slot's ``kv_lens``; the updated pages."""
    return model.decode_paged(tokens, pages, page_table, kv_lens)


def prefill_length(prompt_length: int) -> int:
    """Prompts are padded to powers of two (>= 16): few shapes to compile."""
    return max(16, 1 << (prompt_length - 1).bit_length())


class Server:
    """Batch slots over one paged cache; `run` serves requests to the end."""

    def __init__(self, model: train_lm.LanguageModel, *, slots: int, page_size: int,
                 num_pages: int, max_len: int, temperature: float, seed: int):
        self.model, self.page_size, self.temperature = model, page_size, temperature
        attention = model.blocks[0].attention
        shape = (num_pages, page_size, attention.num_kv_heads, attention.head_dim)
        dtype = model.embed.embedding[...].dtype if attention.dtype is None else attention.dtype
        self.pages = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                      for _ in model.blocks]
        self.pool = PagePool(num_pages)
        self.table = np.full((slots, -(-max_len // page_size)), -1, np.int32)
        self.lens = np.zeros(slots, np.int32)
        self.slots: list[Request | None] = [None] * slots
        self.next_tokens = np.zeros(slots, np.int32)
        self.rng = np.random.default_rng(seed)

    def _sample(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        weights = np.exp((logits - logits.max()) / self.temperature)
        return int(self.rng.choice(len(weights), p=weights / weights.sum()))

    def _forward(self, tokens: np.ndarray, rows: slice, lens: np.ndarray) -> np.ndarray:
        logits, self.pages = forward(self.model, jnp.asarray(tokens), self.pages,
                                     jnp.asarray(self.table[rows]), jnp.asarray(lens))
        return np.asarray(logits)

    def warm_up(self, prompt_lengths: set[int]) -> None:
        """Compiles every step shape on slots without pages (their writes are dropped)."""
        free_rows = np.full_like(self.table, -1)
        saved, self.table = self.table, free_rows
        for length in sorted({prefill_length(n) for n in prompt_lengths}):
            self._forward(np.zeros((1, length), np.int32), slice(0, 1), np.zeros(1, np.int32))
        self._forward(np.zeros((len(self.slots), 1), np.int32), slice(None), self.lens)
        self.table = saved

    def _admit(self, slot: int, request: Request) -> None:
        """Takes the prompt's pages and prefills it alone; samples the first new token."""
        length = len(request.prompt)
        request.pages = [self.pool.take() for _ in range(-(-length // self.page_size))]
        self.table[slot, :len(request.pages)] = request.pages
        tokens = np.zeros((1, prefill_length(length)), np.int32)
        tokens[0, :length] = np.frombuffer(request.prompt, np.uint8)
        # Padding past the prompt lands on no page or past the length: never attended.
        logits = self._forward(tokens, slice(slot, slot + 1), np.zeros(1, np.int32))
        self.lens[slot] = length
        self.slots[slot] = request
        self._emit(slot, self._sample(logits[0, length - 1]))

    def _emit(self, slot: int, token: int) -> None:
        request = self.slots[slot]
        request.output.append(token)
        self.next_tokens[slot] = token
        if len(request.output) == request.max_new:  # done: its pages and slot are free
            self.pool.give_back(request.pages)
            self.table[slot] = -1
            self.lens[slot] = 0
            self.slots[slot] = None

    def _decode_step(self) -> None:
        active = [s for s, request in enumerate(self.slots) if request is not None]
        for slot in active:  # the token fed now goes to position lens[slot]
            if self.lens[slot] % self.page_size == 0:
                page = self.pool.take()
                self.slots[slot].pages.append(page)
                self.table[slot, self.lens[slot] // self.page_size] = page
        logits = self._forward(self.next_tokens[:, None], slice(None), self.lens)
        for slot in active:
            self.lens[slot] += 1
            self._emit(slot, self._sample(logits[slot, 0]))

    def run(self, requests: list[Request]) -> dict:
        """Serves ``requests`` (sorted by arrival); returns counts and timings."""
        waiting = collections.deque(requests)
        step, decode_steps, occupied = 0, 0, 0
        start = time.perf_counter()
        while waiting or any(self.slots):
            for slot in range(len(self.slots)):
                if self.slots[slot] is None and waiting and waiting[0].arrival_step <= step:
                    self._admit(slot, waiting.popleft())
            if any(self.slots):
                occupied += sum(r is not None for r in self.slots)
                self._decode_step()
                decode_steps += 1
            step += 1
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output) for r in requests)
        return dict(requests=len(requests), output_tokens=tokens, seconds=seconds,
                    tokens_per_second=tokens / seconds, decode_steps=decode_steps,
                    mean_batch=occupied / max(decode_steps, 1),
                    free_pages=len(self.pool.free))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path,
                        default=Path("train_lm_out") / "checkpoint.npz",
                        help="train_lm.py's checkpoint (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="pages in the pool (default: every slot at its longest)")
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(8, 120))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--arrivals-per-step", type=float, default=0.5,
                        help="mean requests arriving per decode step")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--implementation", default=None, choices=("xla", "triton"),
                        help="paged_attention implementation (default: best available)")
    parser.add_argument("--dtype", default="float32", help="cache and computation dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no per-request text")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> tuple[dict, list[Request]]:
    args = parse_args(argv)
    if not args.checkpoint.exists():
        raise SystemExit(f"{args.checkpoint} not found: run examples/train_lm.py first "
                         f"(or pass --checkpoint)")
    model = load_model(args.checkpoint, args.dtype, args.implementation)
    rng = np.random.default_rng(args.seed)
    requests = make_requests(args.requests, tuple(args.prompt_lengths), tuple(args.new_tokens),
                             args.arrivals_per_step, rng)
    max_len = args.prompt_lengths[1] + args.new_tokens[1]
    pages_per_seq = -(-max_len // args.page_size)
    server = Server(model, slots=args.slots, page_size=args.page_size,
                    num_pages=args.num_pages or args.slots * pages_per_seq, max_len=max_len,
                    temperature=args.temperature, seed=args.seed)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {len(model.blocks)} "
          f"layers; {args.requests} requests over {args.slots} slots, pages of "
          f"{args.page_size} tokens")
    server.warm_up({len(r.prompt) for r in requests})
    stats = server.run(requests)
    if not args.quiet:
        for request in requests:
            text = (request.prompt + bytes(request.output)).decode("utf-8", errors="replace")
            print(f"--- request {request.number} (prompt {len(request.prompt)} bytes, "
                  f"{len(request.output)} new)\n{text}")
    print(f"served {stats['requests']} requests: {stats['output_tokens']} output tokens in "
          f"{stats['seconds']:.2f} s = {stats['tokens_per_second']:.0f} tokens/s "
          f"({stats['decode_steps']} decode steps, {stats['mean_batch']:.1f} sequences "
          f"per step on average)")
    return stats, requests


if __name__ == "__main__":
    main()
