"""Progress display, metrics and (later) exporters. Used by drivers, never by the core."""
