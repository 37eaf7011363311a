"""The ``poollab`` command line: the thinnest layer over ``policies``, ``traces``, ``sim`` and
``realgpu``."""

__version__ = "0.1.0"
