"""Training of the shipped models: a code target and a distilled drafter (``specdec train ...``)."""
