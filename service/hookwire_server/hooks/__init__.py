"""Hooks as data and as torch hooks: specs, records, rules, captures, selection,
slots, the hook manager (sessions, subscriptions) and event delivery."""
