"""upcycle subpackage."""
