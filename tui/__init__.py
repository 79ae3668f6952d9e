"""`basal-local top`: a Textual dashboard that follows a daemon over HTTP (`/api/stats`, `/api/events`)."""
