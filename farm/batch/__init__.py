"""The OpenAI Batch API: files and batches (api/routes/files.py, api/routes/batches.py), durable state in
Redis and on disk (store), up-front validation (validate), prefix-grouped scheduling (schedule), and the
batch driver that runs lines through the Gateway below interactive traffic (driver, tasks/batch.py)."""
