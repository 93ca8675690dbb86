"""reports subpackage."""
