"""Fixtures of the integration tier."""

from tests.browser import browser, open_page  # noqa: F401 (the browser fixtures, for the page tests)
