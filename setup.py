"""The one part of the build pyproject.toml declares only as an experimental setting: the
compiled OTLP byte reader and span record builder.

``collectors/otlp_wire.py`` and ``collectors/normalize.py`` are their references, and read bodies
and build records wherever these extensions were not built (no C compiler or Python headers):
``optional``, so an install never fails on them.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("collectors._otlp_wire", ["collectors/_otlp_wire.c"], optional=True),
                   Extension("collectors._normalize", ["collectors/_normalize.c"], optional=True)])
