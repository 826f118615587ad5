"""A base class that lets an object cross a torch.compile graph as an opaque value.

torch.compile can hand a Python object to a custom op unchanged only if its class is
registered as an opaque type; recent torch requires such classes to derive from its
custom-class base. Older torch has neither, and then the class is a plain object and the
compiled path is unavailable (the engine runs eagerly).
"""

from __future__ import annotations

try:  # torch >= 2.14
    from torch._custom_class_base import CustomClassBase as OpaqueBase
except ImportError:  # pragma: no cover - depends on the installed torch
    OpaqueBase = object  # type: ignore[assignment,misc]


def register_opaque(cls: type) -> bool:
    """Register `cls` as a symbolic opaque type; False when this torch cannot."""
    try:
        try:
            from torch._library.opaque_object import register_custom_class
        except ImportError:  # pragma: no cover - older torch
            from torch._library.opaque_object import register_opaque_type

            register_opaque_type(cls, typ="reference")
            return True
        register_custom_class(cls, typ="symbolic")
        return True
    except (ImportError, TypeError, ValueError, AttributeError):  # pragma: no cover
        return False
