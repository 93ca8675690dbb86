"""tasks subpackage."""
