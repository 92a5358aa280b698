"""n > 1 fan-out, as vLLM's `parallel_sampling.py` does it: one engine request per choice, interleaved.

Child `i` of request `R` is the engine request `{i}_R` with seed `seed + i` (when a seed is
given); a single choice keeps the parent's id and seed. The children run concurrently and their
outputs are merged in arrival order; the first failure fails the whole request and closes the
other children (closing an engine stream aborts its engine request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec

from mmserve.wire import EngineCoreRequest, SamplingParams

T = TypeVar("T")


def child_request(
    request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, n: int, index: int, arrival_time: float,
    reasoning_ended: bool | None = None, reasoning_parser_kwargs: dict[str, Any] | None = None,
) -> EngineCoreRequest:
    """The engine request of choice `index` out of `n` (`reasoning_ended`: `output_parsing.reasoning_ended`;
    `reasoning_parser_kwargs`: set with a reasoning parser, see `serving_chat`)."""
    if n > 1:
        request_id = f"{index}_{request_id}"
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=sampling.seed + index)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=None,
        sampling_params=sampling,
        pooling_params=None,
        arrival_time=arrival_time,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        reasoning_ended=reasoning_ended,
        reasoning_parser_kwargs=reasoning_parser_kwargs,
    )


async def interleave(n: int, child: Callable[[int], AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of `child(0)` … `child(n - 1)`, as they arrive (n > 1 runs concurrently)."""
    if n == 1:
        async for item in child(0):
            yield item
        return
    queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for item in child(index):
                await queue.put(item)
            await queue.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i)) for i in range(n)]
    try:
        remaining = n
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
