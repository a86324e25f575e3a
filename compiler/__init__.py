"""goinfer's offline compiler: checkpoint -> TVM -> .giw bundle. Importing it does not import TVM."""

__version__ = "0.1.0"
