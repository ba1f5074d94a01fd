"""Tool calling for the chat endpoint: OpenAI's `tools` and `tool_choice` into the prompt, the
model's tool calls back out of its text.

- **Prompt.** A chat template that knows tools (it mentions them) gets `tools=` from
  `apply_chat_template` and the history as OpenAI sends it (assistant `tool_calls` with their
  arguments as objects, `tool` messages). Any other template gets the Hermes convention, which
  most open models were tuned on: the tools described in the system message, past calls written
  into the assistant's text as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and
  tool results sent as user messages wrapped in `<tool_response>`.
- **Output.** With `tool_choice: "auto"` the text is searched for `<tool_call>` blocks; each
  that parses into a known tool's name and an object of arguments becomes a call (the rest of the
  text stays the content). With `"required"` or a named function the output is held, by the
  grammar engine, to one call's JSON, `{"name": ..., "arguments": {...}}`, whose arguments follow
  the function's parameters; `"none"` leaves the tools out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES_SYSTEM = ("You may call one or more functions to assist with the user query. The functions are described "
                 "within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
                 "JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
                 "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


class ToolError(ValueError):
    """Tools, a tool choice or a history that cannot be used; `param` is the field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """A request's tools and what it asks of them."""

    functions: dict[str, dict]  # name -> OpenAI's function object (name, description, parameters)
    choice: str | None  # "auto", "required", or the name of the one function to call; None: "none"

    @classmethod
    def of(cls, tools: list | None, tool_choice) -> Tools | None:
        """The request's `tools` and `tool_choice` checked; None when no tool may be called."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        functions = {}
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ToolError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise ToolError(f"tools[{index}].function.parameters must be a JSON schema", "tools")
            functions[function["name"]] = function | {"parameters": parameters}
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in functions:
                raise ToolError(f"tool_choice names a function that is not among the tools: {name!r}", "tool_choice")
            choice = name
        elif choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        return None if choice == "none" else cls(functions, choice)

    @property
    def forced(self) -> bool:
        """Whether the output must be a call (the grammar holds it to one)."""
        return self.choice != "auto"

    def schema(self) -> dict:
        """The JSON schema of one call the choice allows: `{"name": ..., "arguments": {...}}`."""
        names = list(self.functions) if self.choice == "required" else [self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": self.functions[name]["parameters"]},
                  "required": ["name", "arguments"]} for name in names]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """`(content, tool_calls)` of the model's text: a forced choice's text is one call's JSON;
        otherwise the `<tool_call>` blocks that parse into a known tool's call (the others stay text)."""
        if self.forced:
            call = self.parsed(text)
            return (None, [call]) if call is not None else (text, [])
        calls, kept, end = [], [], 0
        for match in CALL.finditer(text):
            call = self.parsed(match.group(1))
            if call is None:
                continue
            kept.append(text[end:match.start()])
            end = match.end()
            calls.append(call)
        kept.append(text[end:])
        content = "".join(kept).strip()
        return (content or None) if calls else text, calls

    def parsed(self, text: str) -> dict | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not (isinstance(value, dict) and value.get("name") in self.functions
                and isinstance(value.get("arguments", {}), dict)):
            return None
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(value.get("arguments", {}))}}


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it refers to them)."""
    return bool(template) and "tools" in template


def hermes_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The messages for a template that knows nothing of tools: the tools in the system message,
    past calls in the assistant's text, tool results as user messages."""
    out = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            written = "".join(f"<tool_call>\n{json.dumps({'name': c['name'], 'arguments': c['arguments']})}\n"
                              f"</tool_call>" for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (message.get("content") or "") + written})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    if tools is not None:
        described = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools.template_tools()))
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
