"""Text layer of the gateway: tokenizer, chat templates, incremental detokenization and stop
conditions, all matching vLLM's OpenAI server byte for byte (without importing
vllm/torch/transformers). The model directory's files are read by `mmserve.model_files`."""

from ..model_files import ModelFiles
from .chat_template import ChatTemplate, load_chat_template
from .conversation import (
    ContentFormat,
    ContentPart,
    ConversationMessage,
    MediaContent,
    MediaPlaceholders,
    TextContent,
    ToolCall,
    to_conversation,
)
from .detokenizer import IncrementalDetokenizer
from .stop import SequenceText, StopTokenIds, check_stop_strings, resolve_stop_token_ids, stop_token_reason
from .template_env import detect_content_format
from .tokenizer import Tokenizer
from ..tokenizer_files import TokenizerClass, UnsupportedTokenizerError

__all__ = [
    "ChatTemplate",
    "ContentFormat",
    "ContentPart",
    "ConversationMessage",
    "IncrementalDetokenizer",
    "MediaContent",
    "MediaPlaceholders",
    "ModelFiles",
    "SequenceText",
    "StopTokenIds",
    "TextContent",
    "Tokenizer",
    "TokenizerClass",
    "ToolCall",
    "check_stop_strings",
    "detect_content_format",
    "load_chat_template",
    "resolve_stop_token_ids",
    "stop_token_reason",
    "to_conversation",
    "UnsupportedTokenizerError",
]
