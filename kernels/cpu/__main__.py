from . import _check

_check()
