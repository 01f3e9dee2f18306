//! The server against real SQLite stores: the API in-process (the router
//! called without a socket) and over a real socket on 127.0.0.1:0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::disallowed_methods)]

mod api;
mod fixture;
mod reports;
