"""kit/structured_api.py - OpenAI's structured-output fields as constraints, and tool calls back as JSON.

Chapter 11 constrains decoding with `SamplingParams.structured`; this file maps the wire's
ways of asking for it onto that one field:

- `response_format` `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`;
- vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- `tools` with `tool_choice`: the model is told the functions in a system message, and its reply is
  either free text or `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format
  many open models are trained on), the arguments held to the function's `parameters` schema by an
  xgrammar structural tag. The reply's call is parsed back into OpenAI's `tool_calls`.

No xgrammar here: SamplingParams checks (and the engine compiles) what this builds.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_constraint(req) -> tuple[dict | None, str | None]:
    """({kind: value} for SamplingParams.structured, the field that asked for it), or (None, None).
    At most one field may ask: two constraints on one reply have no meaning."""
    if getattr(req, "tool_choice", None) not in (None, "none") and not req.tools:
        raise FieldError("tool_choice", "tool_choice needs tools: there is no function to call")
    asked = [name for name in ("response_format", "tools", "structured_outputs", *GUIDED) if _asks(req, name)]
    if len(asked) > 1:
        raise FieldError(asked[1], f"{asked[0]} and {asked[1]} both constrain the reply; send one of them")
    if not asked:
        return None, None
    field = asked[0]
    if field == "response_format":
        fmt = req.response_format
        if fmt.type == "json_object":
            return {"json_object": True}, field
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise FieldError(field, "response_format of type json_schema needs json_schema.schema")
        return {"json_schema": fmt.json_schema.schema_}, field
    if field == "tools":
        return tools_constraint(req.tools, req.tool_choice), field
    if field == "structured_outputs":   # vLLM's newer spelling of the guided_* fields
        kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object"}
        given = {kinds[k]: v for k, v in req.structured_outputs.model_dump(by_alias=True).items() if v not in (None, False)}
        if len(given) != 1:
            raise FieldError(field, f"structured_outputs takes exactly one of {', '.join(kinds)}")
        return given, field
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}[field]
    return {kind: getattr(req, field)}, field


def _asks(req, name: str) -> bool:
    value = getattr(req, name, None)
    if name == "response_format":
        return value is not None and value.type != "text"
    if name == "tools":
        return bool(value) and tool_choice_name(req.tool_choice) != "none"
    return value is not None


def tool_choice_name(choice) -> str:
    """'none', 'auto' (the default with tools), 'required', or the named function."""
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.function.name


# --8<-- [start:tools]
def tools_constraint(tools: list, choice) -> dict:
    """The structural tag: free text that, once it opens <tool_call>, must finish one valid call.

    'auto' allows either; 'required' and a named function allow only a call (of that function)."""
    wanted = tool_choice_name(choice)
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise FieldError("tools", f"tools[{i}]: the function name {tool.function.name!r} is used twice; "
                                      "a call names its function, so each needs its own name")
        schema = tool.function.parameters
        if schema is not None and (not isinstance(schema, dict) or schema.get("type") != "object"):
            raise FieldError("tools", f"tools[{i}].function.parameters must be a JSON Schema of type 'object' "
                                      "(a call's arguments are named)")
    if wanted not in ("auto", "required") and wanted not in names:
        raise FieldError("tool_choice", f"tool_choice names the function {wanted!r}, which is not in tools ({names})")
    chosen = [t for t in tools if wanted in ("auto", "required") or t.function.name == wanted]
    tags = [{"begin": f'{TOOL_OPEN}{{"name": {json.dumps(t.function.name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t.function.parameters or {"type": "object"}},
             "end": f"}}{TOOL_CLOSE}"} for t in chosen]
    fmt = {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": tags,
           "at_least_one": wanted != "auto",       # required: the reply starts with a call
           "stop_after_first": True}               # one call per reply, then EOS
    return {"structural_tag": {"type": "structural_tag", "format": fmt}}


def tools_system_prompt(tools: list) -> str:
    """What the model is told about the functions it may call, and how to call them."""
    described = [{"name": t.function.name, "description": t.function.description or "",
                  "parameters": t.function.parameters or {"type": "object"}} for t in tools]
    return ("You can call functions. To call one, reply with only\n"
            f'{TOOL_OPEN}{{"name": <function name>, "arguments": <arguments as JSON>}}{TOOL_CLOSE}\n'
            f"The functions:\n{json.dumps(described)}")


def with_tools(messages: list[dict], tools: list) -> list[dict]:
    """The chat with the tools' description added to its system message (made if there is none)."""
    note = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
# --8<-- [end:tools]


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (an assistant's earlier call, sent back in the conversation)."""
    return f'{TOOL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{TOOL_CLOSE}'


class FieldError(ValueError):
    """A request field that cannot be served as sent (the server answers 400 naming it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# --8<-- [start:parse]
CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)


def parse_tool_call(text: str) -> tuple[str | None, dict] | None:
    """(content before the call or None, OpenAI's tool_calls entry) if the text holds a complete call."""
    match = CALL.search(text)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
        name, arguments = call["name"], call["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    content = text[:match.start()].strip() or None
    return content, {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": name, "arguments": json.dumps(arguments)}}


def without_unfinished_call(text: str, cut_short: bool) -> str:
    """A reply with no complete call: the text before a call it opened, since half a call is
    neither content nor a call. Cut short by the budget, a tail that may be the first letters of
    `<tool_call>` goes too (the model was writing the tag when it ran out)."""
    cut = text.find(TOOL_OPEN)
    if cut < 0 and cut_short:
        cut = next((i for i in range(max(0, len(text) - len(TOOL_OPEN) + 1), len(text))
                    if TOOL_OPEN.startswith(text[i:])), -1)
    return text if cut < 0 else text[:cut]


class HoldBack:
    """A stream's text, minus anything that may be the start of a tool call: that waits for the end."""

    def __init__(self):
        self.text, self.sent = "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        cut = self.text.find(TOOL_OPEN)
        if cut < 0:   # hold back a tail that could still grow into "<tool_call>"
            cut = next((i for i in range(max(self.sent, len(self.text) - len(TOOL_OPEN) + 1), len(self.text))
                        if TOOL_OPEN.startswith(self.text[i:])), len(self.text))
        out, self.sent = self.text[self.sent:max(cut, self.sent)], max(cut, self.sent)
        return out

    def rest(self, cut_short: bool = False) -> str:
        """At the end, with no complete call: the text that was held back, up to a call cut short."""
        kept = without_unfinished_call(self.text, cut_short)
        out, self.sent = kept[self.sent:], len(self.text)
        return out
# --8<-- [end:parse]
