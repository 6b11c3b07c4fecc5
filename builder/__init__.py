"""mopt: build, compile, smoke-test and publish GPU inference images from a version matrix.

The host side (this package) never imports torch or TensorRT; the in-image runtime lives in
builder/runtime and imports only what the image has.
"""

__version__ = "0.1.0"
