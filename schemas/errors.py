"""The one typed refusal of a request value, raised where a value is checked
(schemas, core) and carried as data to the client: `param` becomes OpenAI's
`error.param` (through EngineCoreOutput.error_param across the process
boundary), `message` says why. A ValueError, so callers that catch those keep
working; str() stays "param: message"."""
from __future__ import annotations

import re

# "field: message", the form of ValueErrors not (yet) raised as ParamError
PARAM_PREFIX = re.compile(r"^([A-Za-z_][\w\.\[\]]*): ")


class ParamError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}" if param else message)


def param_of(err: ValueError) -> str | None:
    """The field a refusal names: a ParamError's own; else read from the
    "field: message" text (once, where the error is turned into data)."""
    param = getattr(err, "param", None)
    if param is None and (m := PARAM_PREFIX.match(str(err))):
        param = m.group(1)
    return param
