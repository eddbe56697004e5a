"""start_app.py: launching deployments under gunicorn, and the demo's deployment."""
