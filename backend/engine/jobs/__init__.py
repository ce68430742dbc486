"""A running job's records: claiming a job, and the store its writes go through (`backend/engine/jobstore.py`)."""
