"""Tool calling: prompting with tools, forcing calls with a grammar, parsing calls back.

`prompt.render_chat` puts tools, past calls and results through the chat template;
`schema` builds the JSON schemas that force calls (tool_choice "required" or a named
function); `get_tool_parser` returns the parser of a model family's call format by vLLM's
name (`--tool-call-parser`: hermes, llama3_json, mistral, pythonic, qwen3_xml/qwen3_coder,
granite, phi4_mini_json), for tool_choice "auto"; `ToolCallStreamer` streams calls as
they are written.
"""

from pagemill.runtime.tool_calling.parser import (
    TOOL_PARSER_NAMES,
    ExtractedToolCalls,
    ParsedOutput,
    PartialCall,
    ToolCall,
    ToolParser,
    get_tool_parser,
    parser_for_template,
)
from pagemill.runtime.tool_calling.prompt import render_chat
from pagemill.runtime.tool_calling.schema import (
    RequiredCallsParser,
    calls_from_required,
    named_function_schema,
    required_schema,
)
from pagemill.runtime.tool_calling.stream import ToolCallStreamer

__all__ = [
    "TOOL_PARSER_NAMES",
    "ExtractedToolCalls",
    "ParsedOutput",
    "PartialCall",
    "RequiredCallsParser",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "calls_from_required",
    "get_tool_parser",
    "named_function_schema",
    "parser_for_template",
    "render_chat",
    "required_schema",
]
