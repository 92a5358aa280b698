"""Text layer of the gateway: model-dir files, tokenizer, chat templates,
incremental detokenization and stop conditions, all matching vLLM's OpenAI
server byte for byte (without importing vllm/torch/transformers)."""

from .chat_template import (
    ChatMessage,
    ChatTemplate,
    ContentFormat,
    ContentPart,
    MediaPart,
    MediaPlaceholders,
    TextPart,
    ToolCall,
    detect_content_format,
    load_chat_template,
    to_conversation,
)
from .detokenizer import IncrementalDetokenizer
from .model_files import ModelFiles
from .stop import SequenceText, StopTokenIds, check_stop_strings, resolve_stop_token_ids, stop_token_reason
from .tokenizer import Tokenizer

__all__ = [
    "ChatMessage",
    "ChatTemplate",
    "ContentFormat",
    "ContentPart",
    "IncrementalDetokenizer",
    "MediaPart",
    "MediaPlaceholders",
    "ModelFiles",
    "SequenceText",
    "StopTokenIds",
    "TextPart",
    "Tokenizer",
    "ToolCall",
    "check_stop_strings",
    "detect_content_format",
    "load_chat_template",
    "resolve_stop_token_ids",
    "stop_token_reason",
    "to_conversation",
]
