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


# where a msgspec ValidationError points: "Expected `int`, got `str` - at `$.max_whitespace`"
_MSGSPEC_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`$", re.S)


def msgspec_refusal(err: Exception, prefix: str) -> ParamError:
    """A msgspec ValidationError of a value decoded under `prefix` as the ParamError
    naming the field it points at (`$.choice[0]` under "structured_outputs":
    "structured_outputs.choice[0]"); `prefix` itself where it points nowhere."""
    m = _MSGSPEC_AT.match(str(err))
    if m is None:
        return ParamError(prefix, str(err))
    path = m.group(2)
    return ParamError(f"{prefix}.{path}" if path else prefix, m.group(1))
