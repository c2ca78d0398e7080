"""The one part of the build pyproject.toml declares only as an experimental setting: the
compiled OTLP byte reader.

``collectors/otlp_wire.py`` is its reference and reads bodies wherever this extension was not
built (no C compiler or Python headers): ``optional``, so an install never fails on it.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("collectors._otlp_wire", ["collectors/_otlp_wire.c"], optional=True)])
