"""The chat page: under Streamlit's AppTest and in a real browser."""
