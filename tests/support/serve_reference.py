"""`vllm serve`'s own answers, in the shape of the offline reference's (``ReferenceResult``).

The cases are those of ``vllm_reference.run_offline_reference``: ``{"messages": [...], "sampling": {...},
"chat_kwargs": {...}}`` goes to ``/v1/chat/completions``, ``{"prompt_token_ids": [...], "sampling": {...}}``
to ``/v1/completions``, one request at a time. Sampling keywords are vLLM's ``SamplingParams`` names,
which vLLM's server takes as request fields under the same names (``stop``, ``seed``, ``n``,
``ignore_eos``, ``min_tokens``, ``include_stop_str_in_output`` ...), and so are ``LLM.chat``'s keyword
arguments (``add_generation_prompt``, ``continue_final_message``). ``return_token_ids`` (vLLM ≥ 0.10.2)
gives the prompt's and every choice's token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from .vllm_engines import VllmApiServer
from .vllm_reference import ReferenceOutput, ReferenceResult


@dataclass
class ServeReference:
    server: VllmApiServer
    model_name: str

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def answers(self, cases: list[dict]) -> list[ReferenceResult]:
        return [self._answer(case) for case in cases]

    def _answer(self, case: dict) -> ReferenceResult:
        body = {"model": self.model_name, "return_token_ids": True, **case["sampling"]}
        if "messages" in case:
            route, body = "/v1/chat/completions", {**body, "messages": case["messages"], **case.get("chat_kwargs", {})}
        else:
            route, body = "/v1/completions", {**body, "prompt": case["prompt_token_ids"]}
        resp = httpx.post(self.base_url + route, json=body, timeout=300)
        assert resp.status_code == 200, f"vllm serve answered {resp.status_code}: {resp.text}\n{self.server.log_tail(20)}"
        answer = resp.json()
        outputs = [
            ReferenceOutput(
                index=choice["index"],
                token_ids=choice["token_ids"],
                text=choice["message"]["content"] if "message" in choice else choice["text"],
                finish_reason=choice["finish_reason"],
                stop_reason=choice.get("stop_reason"),
            )
            for choice in answer["choices"]
        ]
        prompt_token_ids = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        return ReferenceResult(prompt_token_ids, outputs)
