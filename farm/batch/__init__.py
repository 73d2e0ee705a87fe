"""The OpenAI Batch API: files and batches (api/routes/files.py, api/routes/batches.py), durable state in Redis
(store) with file bodies on disk or in Redis (file_store), up-front validation (validate), prefix-grouped
scheduling (schedule), and the batch driver that runs lines through the Gateway below interactive traffic
(driver, tasks/batch.py), one module per concern: the validating stage (preparation), one line's run (line), its
result, the owner's quota and the output files (results), the window of lines in flight (throttle), the driver's
lease on a batch (lease), and handing batches to drivers with the reaper (handoff)."""
