"""Hugging Face reference computations that tests of the gateway venv run in the reference venv.

Called through ``reference_venv.call_in_reference("tests.support.hf_reference:<function>", ...)``:
plain JSON arguments and results.
"""

from __future__ import annotations


def chat_template_ids(model_dir: str, chats: list[list[dict]]) -> list[list[int]]:
    """`AutoTokenizer.apply_chat_template(chat, add_generation_prompt=True)` ids for each chat."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    result = []
    for chat in chats:
        ids = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        result.append([int(i) for i in ids])
    return result
