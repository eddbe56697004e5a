"""The shipped JSON configs; a package only so that the wheel carries them as package data."""
