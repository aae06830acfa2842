//! srq
