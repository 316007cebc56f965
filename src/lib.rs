//! meshgate: a multi-tenant gateway node.
