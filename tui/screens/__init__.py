"""One screen per view (keys 1-5) plus the modal request detail and help screens."""
