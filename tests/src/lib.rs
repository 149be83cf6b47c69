//! Workspace-level integration tests and the dev-only fixture helpers they share.
