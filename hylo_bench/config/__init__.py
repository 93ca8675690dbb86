"""Configuration, the ground floor every command builds on: units (lengths, bytes, dtypes, devices), recipes, the
training-mixture format, student dimensions and the run configs with their defaults (``UpcycleConfig``)."""
