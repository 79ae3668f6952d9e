"""The Batch and Files API's work: files and batches kept on disk (`store`), and the task that runs them (`runner`).
The HTTP routes are `server/batch_routes.py`."""
