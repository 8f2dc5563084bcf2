"""Exception types: one for user error, one for a broken internal invariant."""


class PackstreamError(ValueError):
    """A user-facing error: bad input, bad option, or data that breaks the contract.

    Messages name the value, the limit and the fix; the CLI prints them without a traceback.
    """


class ContractError(PackstreamError):
    """Data that does not follow the packed-row contract (:mod:`packers._schema`)."""


class InternalError(RuntimeError):
    """A broken internal invariant: a bug in packstream, never the user's fault."""
