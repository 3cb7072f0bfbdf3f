"""Hosts other than our own servers, standing on the admission runtime (tokenpools.admission)."""
