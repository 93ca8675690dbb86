"""Text handling shared by the wings: chat rendering (``chat``)."""
