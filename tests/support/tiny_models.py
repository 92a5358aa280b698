"""Tiny random-weight models for tests: built locally because nothing can be downloaded here.

``build_tiny_qwen2_vl`` = the committed built-in model directory (``mmserve/builtin_engine/model``,
written by ``scripts/make_builtin_model.py``: configs + tokenizer) + random weights made with
transformers. ``build_tiny_llava`` = a tiny LLaVA-1.5 (llava-hf layout). ``build_tiny_models`` builds
any of ``TINY_MODELS`` (Qwen2.5-VL and Qwen3-VL too), several in one process: the session's models are
made that way (tests/support/session_vllm.py).

Weights are re-drawn from N(0, 0.2) (norm weights from N(1, 0.2)) with a fixed seed: transformers'
own init (std 0.02, norms at 1) gives nearly flat logits, and greedy decoding then repeats one token
whatever the input. With std 0.2 the logits have a spread of a few units, so greedy outputs depend on
the prompt and the image. Everything is deterministic for a given seed (CPU, fixed draw order).

The builders need torch and transformers, so they run in the reference venv (a subprocess of
``reference_venv.reference_python()``): the tests that use these models run from the gateway venv.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .reference_venv import call_in_reference

REPO = Path(__file__).resolve().parents[2]
BUILTIN_MODEL_DIR = REPO / "mmserve" / "builtin_engine" / "model"
WEIGHT_STD = 0.2


THINK_TOKENS = ("<think>", "</think>")


def write_think_tokenizer_files(dest: Path, extra_tokens: tuple[str, ...] = ()) -> Path:
    """The built-in model's files, its tokenizer with `<think>` and `</think>` added as Qwen3 adds them
    (plain added tokens, not special, after the last added token): for the reasoning parser's tests.
    `extra_tokens` are added after them the same way (Qwen3's `<tool_call>` and `</tool_call>`)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for path in BUILTIN_MODEL_DIR.iterdir():
        if path.is_file():
            shutil.copyfile(path, dest / path.name)
    tokenizer = json.loads((dest / "tokenizer.json").read_text())
    config = json.loads((dest / "tokenizer_config.json").read_text())
    next_id = max(t["id"] for t in tokenizer["added_tokens"]) + 1
    for offset, content in enumerate(THINK_TOKENS + tuple(extra_tokens)):
        token = {"id": next_id + offset, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": False}  # fmt: skip
        tokenizer["added_tokens"].append(token)
        config["added_tokens_decoder"][str(token["id"])] = {k: v for k, v in token.items() if k != "id"}
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def _redraw_(model, seed: int) -> None:
    """Re-draw every parameter in place, in name order, from one seeded generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * WEIGHT_STD
            # Norm scales around 1 (not 0) so activations keep their size through the layers.
            is_norm = p.ndim == 1 and ("norm" in name or name.endswith("ln_q.weight"))
            p.copy_(noise + 1.0 if is_norm and name.endswith("weight") else noise)


def _save_weights(model, dest: Path) -> None:
    """save_pretrained into a scratch dir and keep only the safetensors (the configs in ``dest``
    are the committed ones; transformers 5 would rewrite config.json in its own layout)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in sorted(Path(tmp).glob("*.safetensors*")):
            shutil.copyfile(f, dest / f.name)


# The tiny Qwen2-VL's chat template: Qwen2-VL's, unchanged for requests without tools, and for requests
# with tools a branch of our own in the Hermes format Qwen2.5 and Qwen3 use (tools as JSON in the system
# prompt, the history's calls in <tool_call>, tool results in <tool_response>), so that the tools a
# request carries, exactly as vLLM hands them to the template, are in the prompt the tests compare.
_CONTENT_MACRO = (
    "{% macro content_text(content) %}{% if content is string %}{{ content }}{% elif content %}"
    "{% for part in content %}{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)
_TOOLS_BRANCH = (  # (a newline right after a block tag is dropped: transformers renders with trim_blocks)
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ content_text(messages[0]['content']) }}\n\n"
    "{% else %}You are a helpful assistant.\n\n{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures, one JSON object per line:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "To call one, write its name and arguments as a JSON object between <tool_call> and </tool_call>:\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n</tool_call><|im_end|>\n"
    "{% for message in messages %}{% if not (loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ content_text(message['content']) }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ content_text(message['content']) }}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_vl_template_with_tools(template: str) -> str:
    """Qwen2-VL's ``template`` with the tools branch above."""
    return _CONTENT_MACRO + "{% if tools %}" + _TOOLS_BRANCH + "{% else %}" + template + "{% endif %}"


def _add_tools_to_template(dest: Path) -> None:
    for name in ("chat_template.json", "tokenizer_config.json"):
        data = json.loads((dest / name).read_text())
        data["chat_template"] = qwen2_vl_template_with_tools(data["chat_template"])
        (dest / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def build_tiny_qwen2_vl(dest: Path, seed: int = 0) -> Path:
    """Copy the built-in Qwen2-VL model dir to ``dest`` and add random bf16 weights. Returns ``dest``."""
    call_in_reference("tests.support.tiny_models:_build_tiny_qwen2_vl_here", str(dest), seed)
    return Path(dest)


def _save_random_qwen2_vl(dest: Path, seed: int) -> None:  # in the reference venv
    """Random bf16 weights for the Qwen2-VL whose config is in `dest`."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    _redraw_(model, seed)
    model = model.to(torch.bfloat16)
    _save_weights(model, dest)


def _build_tiny_qwen2_vl_here(dest: str, seed: int) -> None:  # in the reference venv
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(BUILTIN_MODEL_DIR.iterdir()):
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
    _add_tools_to_template(dest)
    _save_random_qwen2_vl(dest, seed)


def _build_tiny_thinking_qwen2_vl_here(dest: str, seed: int) -> None:  # in the reference venv
    """The tiny Qwen2-VL with `<think>` and `</think>` as tokens of its vocabulary (two more rows) and a
    thinking model's generation prompt (`<|im_start|>assistant\n<think>\n`, as Qwen3's thinking templates
    end it): the model writes reasoning first, for the reasoning parser's end-to-end test."""
    dest = write_think_tokenizer_files(Path(dest))
    for name in ("chat_template.json", "tokenizer_config.json"):
        data = json.loads((dest / name).read_text())
        template = data["chat_template"]
        opening = "<|im_start|>assistant\n"
        assert template.count(opening) == 1, "the generation prompt is written once"
        data["chat_template"] = template.replace(opening, opening + "<think>\n")
        (dest / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    config = json.loads((dest / "config.json").read_text())
    config["vocab_size"] = config["vocab_size"] + len(THINK_TOKENS)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_random_qwen2_vl(dest, seed)


def _qwen2_5_vl_config() -> dict:
    """A tiny Qwen2.5-VL in Qwen/Qwen2.5-VL-3B-Instruct's config.json layout (flat text keys): the
    built-in model's text decoder and token ids, and a 2-block windowed vision tower (block 1 with
    full attention) whose merger projects to the text hidden size."""
    config = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())
    config.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl")
    config["vision_config"] = {
        "depth": 2,
        "fullatt_block_indexes": [1],
        "hidden_act": "silu",
        "hidden_size": 64,  # the vision embed dim
        "in_channels": 3,
        "in_chans": 3,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": config["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
    }
    return config


def write_qwen2_5_vl_files(dest: Path) -> Path:
    """The tiny Qwen2.5-VL's files without weights (enough for tokenizer and image processor)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(BUILTIN_MODEL_DIR.iterdir()):
        if f.is_file():
            shutil.copyfile(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(_qwen2_5_vl_config(), indent=2, sort_keys=True) + "\n")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        cfg = json.loads((dest / name).read_text())
        cfg["processor_class"] = "Qwen2_5_VLProcessor"
        (dest / name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dest


def _build_tiny_qwen2_5_vl_here(dest: str, seed: int) -> None:  # in the reference venv
    """The built-in model dir's tokenizer, chat template and Qwen2-VL image processor (Qwen2.5-VL keeps
    that processor class) with a Qwen2.5-VL config and random bf16 weights."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    dest = write_qwen2_5_vl_files(dest)
    config = Qwen2_5_VLConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    _redraw_(model, seed)
    model = model.to(torch.bfloat16)
    _save_weights(model, dest)


# Qwen3-VL's image processor (Qwen2VLImageProcessor with 16x16 patches, factor 32, mean/std 0.5).
# longest_edge is capped (Qwen3-VL ships 16 777 216 pixels) so test images stay at <= 256 tokens.
QWEN3_VL_MIN_PIXELS = 65536
QWEN3_VL_MAX_PIXELS = 32 * 32 * 256


def _qwen3_vl_config() -> dict:
    """A tiny Qwen3-VL in Qwen/Qwen3-VL-2B-Instruct's config.json layout: the built-in model's token
    ids and vocabulary, a 2-layer Qwen3 text decoder (interleaved mRoPE), a 2-block vision tower with
    16x16 patches and one deepstack layer."""
    builtin = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())
    token_ids = {k: builtin[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        **token_ids,
        "tie_word_embeddings": False,
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": builtin["bos_token_id"],
            "eos_token_id": builtin["eos_token_id"],
            "dtype": "bfloat16",
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": builtin["hidden_size"],
            "initializer_range": 0.02,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [12, 10, 10], "rope_type": "default"},
            "rope_theta": 5000000,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": builtin["vocab_size"],
        },
        "vision_config": {
            "deepstack_visual_indexes": [0],
            "depth": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 64,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "model_type": "qwen3_vl",
            "num_heads": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": builtin["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }


def write_qwen3_vl_files(dest: Path) -> Path:
    """The tiny Qwen3-VL's files without weights: the built-in model's tokenizer and chat template
    (Qwen2-VL's, which vLLM and mmserve render alike), Qwen3-VL's config and image processor."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "generation_config.json"):
        shutil.copyfile(BUILTIN_MODEL_DIR / name, dest / name)
    (dest / "config.json").write_text(json.dumps(_qwen3_vl_config(), indent=2, sort_keys=True) + "\n")
    processor = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast", "merge_size": 2, "patch_size": 16,
        "processor_class": "Qwen3VLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": QWEN3_VL_MAX_PIXELS, "shortest_edge": QWEN3_VL_MIN_PIXELS}, "temporal_patch_size": 2,
    }  # fmt: skip
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    video = dict(processor, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=4, max_frames=16)
    video.pop("image_processor_type")
    (dest / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2, sort_keys=True) + "\n")
    return dest


def _build_tiny_qwen3_vl_here(dest: str, seed: int) -> None:  # in the reference venv
    """``write_qwen3_vl_files`` plus random bf16 weights."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    dest = write_qwen3_vl_files(dest)
    config = Qwen3VLConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    _redraw_(model, seed)
    model = model.to(torch.bfloat16)
    _save_weights(model, dest)


# ------------------------------------------------------------------------------------------------
# LLaVA-1.5 (llava-hf/llava-1.5-7b-hf layout, tiny)
# ------------------------------------------------------------------------------------------------
# Token ids follow llava-hf's layout: <unk> 0, <s> 1, </s> 2, byte-fallback tokens <0x00>..<0xFF> at
# 3..258 (as in Llama's SentencePiece vocab), learned pieces up to LLAVA_BPE_VOCAB, then the two tokens
# llava-hf adds at the end: <image> (llava-hf: 32000) and <pad> (32001).
LLAVA_BPE_VOCAB = 1500
LLAVA_IMAGE_TOKEN_ID = LLAVA_BPE_VOCAB  # 1500
LLAVA_PAD_TOKEN_ID = LLAVA_BPE_VOCAB + 1  # 1501
LLAVA_VOCAB_SIZE = LLAVA_BPE_VOCAB + 2

# llava-hf/llava-1.5-7b-hf's chat template, verbatim.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _corpus_lines() -> list[str]:
    """The training text of scripts/make_builtin_model.py (loaded by path: scripts/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_make_builtin_model", REPO / "scripts" / "make_builtin_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.training_lines()


def _llama_style_tokenizer_json() -> str:
    """A SentencePiece-like BPE in the Llama-2 tokenizer.json format llava-hf ships: normalizer
    Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, byte fallback, BOS added by the
    post-processor, decoder Replace/ByteFallback/Fuse/Strip."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Training only: split on spaces so merges never cross words (SentencePiece's default).
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=LLAVA_BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],  # ids 0..258, in this order
        # No limit_alphabet: its frequency ties are broken in hash order (non-deterministic output).
        # Characters absent from the corpus still go through byte fallback, as in Llama.
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    assert got == LLAVA_BPE_VOCAB, f"LLaVA BPE vocab {got} != {LLAVA_BPE_VOCAB}"
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False),
                            AddedToken("<pad>", special=True, normalized=False)])
    d = json.loads(tok.to_str())
    d["pre_tokenizer"] = None
    d["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    d["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    # The trainer registers its special tokens as added tokens; keep <unk>/<s>/</s> (special, as in
    # Llama) and drop the byte tokens (plain vocab entries in Llama's tokenizer.json).
    d["added_tokens"] = [t for t in d["added_tokens"] if not t["content"].startswith("<0x")]
    text = json.dumps(d, indent=2, ensure_ascii=False) + "\n"
    check = Tokenizer.from_str(text)
    assert check.token_to_id("<image>") == LLAVA_IMAGE_TOKEN_ID and check.token_to_id("<pad>") == LLAVA_PAD_TOKEN_ID
    assert check.token_to_id("<0x00>") == 3 and check.token_to_id("<s>") == 1
    return text


def llava_model_files() -> dict[str, dict | str]:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in [(0, "<unk>"), (1, "<s>"), (2, "</s>"), (LLAVA_IMAGE_TOKEN_ID, "<image>"),
                     (LLAVA_PAD_TOKEN_ID, "<pad>")]
    }
    return {
        "tokenizer.json": _llama_style_tokenizer_json(),
        "tokenizer_config.json": {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": added,
            "bos_token": "<s>",
            "chat_template": LLAVA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "legacy": False,
            "model_max_length": 4096,
            "pad_token": "<pad>",
            "padding_side": "left",
            "processor_class": "LlavaProcessor",
            "sp_model_kwargs": {},
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        },
        "chat_template.json": {"chat_template": LLAVA_CHAT_TEMPLATE},
        # Without patch_size / vision_feature_select_strategy / num_additional_image_tokens the HF
        # processor does not expand <image> to 576 tokens.
        "processor_config.json": {
            "image_token": "<image>",
            "num_additional_image_tokens": 1,
            "patch_size": 14,
            "processor_class": "LlavaProcessor",
            "vision_feature_select_strategy": "default",
        },
        "preprocessor_config.json": {
            "crop_size": {"height": 336, "width": 336},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": CLIP_MEAN,
            "image_processor_type": "CLIPImageProcessor",
            "image_std": CLIP_STD,
            "processor_class": "LlavaProcessor",
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": 336},
        },
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": LLAVA_PAD_TOKEN_ID},
        "config.json": {
            "architectures": ["LlavaForConditionalGeneration"],
            "ignore_index": -100,
            "image_seq_length": 576,
            "image_token_index": LLAVA_IMAGE_TOKEN_ID,
            "model_type": "llava",
            "pad_token_id": LLAVA_PAD_TOKEN_ID,
            "projector_hidden_act": "gelu",
            "text_config": {
                "architectures": ["LlamaForCausalLM"],
                "bos_token_id": 1,
                "eos_token_id": 2,
                "head_dim": 64,
                "hidden_act": "silu",
                "hidden_size": 128,
                "intermediate_size": 256,
                "max_position_embeddings": 4096,
                "model_type": "llama",
                "num_attention_heads": 2,
                "num_hidden_layers": 2,
                "num_key_value_heads": 2,
                "rms_norm_eps": 1e-05,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "vocab_size": LLAVA_VOCAB_SIZE,
            },
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vision_config": {
                "hidden_act": "quick_gelu",
                "hidden_size": 64,
                "image_size": 336,  # vLLM requires inputs of exactly this size
                "intermediate_size": 128,
                "layer_norm_eps": 1e-05,
                "model_type": "clip_vision_model",
                "num_attention_heads": 2,
                "num_hidden_layers": 2,
                "patch_size": 14,
                "projection_dim": 64,
            },
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "vocab_size": LLAVA_VOCAB_SIZE,
        },
    }


def build_tiny_llava(dest: Path, seed: int = 0) -> Path:
    """A tiny LLaVA-1.5 (CLIP ViT 336/14 tower with 2 layers, Llama decoder hidden 128) with random
    bf16 weights, in llava-hf's file and state-dict layout. Returns ``dest``."""
    call_in_reference("tests.support.tiny_models:_build_tiny_llava_here", str(dest), seed)
    return Path(dest)


def _build_tiny_llava_here(dest: str, seed: int) -> None:  # in the reference venv
    import torch
    from safetensors.torch import save_file
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name, content in llava_model_files().items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True) + "\n"
        (dest / name).write_text(text, encoding="utf-8")
    config = LlavaConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    _redraw_(model, seed)
    # transformers 5 names the CLIP tower `model.vision_tower.*`; llava-hf checkpoints (and vLLM's
    # loader) have `model.vision_tower.vision_model.*`. Save the state dict ourselves in that layout.
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("model.vision_tower.") and not k.startswith("model.vision_tower.vision_model."):
            k = "model.vision_tower.vision_model." + k[len("model.vision_tower."):]
        state[k] = v.to(torch.bfloat16).contiguous()
    save_file(dict(sorted(state.items())), str(dest / "model.safetensors"), metadata={"format": "pt"})


# The tiny models by the directory name the tests give them, and the function that builds each in the
# reference venv.
TINY_MODELS = {
    "tiny-qwen2-vl": "_build_tiny_qwen2_vl_here",
    "tiny-qwen2_5_vl": "_build_tiny_qwen2_5_vl_here",
    "tiny-qwen3_vl": "_build_tiny_qwen3_vl_here",
    "tiny-llava": "_build_tiny_llava_here",
    "tiny-thinking-qwen2-vl": "_build_tiny_thinking_qwen2_vl_here",
}


def build_tiny_models(root: Path, names: list[str], seed: int = 0) -> dict[str, Path]:
    """Several tiny models, ``root / name`` each, in one reference-venv process: one import of torch
    and transformers for all of them (≈8 s each on this machine)."""
    call_in_reference("tests.support.tiny_models:_build_tiny_models_here", str(root), names, seed)
    return {name: Path(root) / name for name in names}


def _build_tiny_models_here(root: str, names: list[str], seed: int) -> None:  # in the reference venv
    for name in names:
        globals()[TINY_MODELS[name]](str(Path(root) / name), seed)
