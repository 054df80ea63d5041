"""Selectors (config group ``selector``): which drafter of a pool drafts a request's round."""
