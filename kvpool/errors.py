"""Errors raised by kvpool.

KVPoolError
 +-- SpecError          invalid model geometry, page size, TP split or capacity
 +-- AllocatorError     misuse of an allocator (double free, foreign index, bad size)
 +-- OutOfSpace         not enough free pages/slots for a request (nothing was taken)
 +-- LayoutMismatch     a CPU copy or index set does not fit this pool
"""


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose."""


class SpecError(KVPoolError, ValueError):
    pass


class AllocatorError(KVPoolError, ValueError):
    pass


class OutOfSpace(KVPoolError):
    def __init__(self, component: str, needed: int, available: int):
        super().__init__(f"{component}: need {needed}, only {available} free")
        self.component = component
        self.needed = needed
        self.available = available


class LayoutMismatch(KVPoolError, ValueError):
    pass
