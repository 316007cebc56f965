//! Limits checked before a module is compiled: what it declares (functions,
//! locals, globals, data, element segments, tables, memories, types, the
//! largest function body, the deepest nesting of blocks in one body) is
//! counted with wasmtime's own parser and refused over the node's
//! `[functions]` limits.
//!
//! Why: compiling costs time and memory in proportion to what a module
//! declares, not to its size on the wire. A 2 MiB module of 100,000 empty
//! functions took 5.4 s and +640 MB to compile, and a compile cannot be
//! stopped once it runs (the deadline of `gate.rs` only stops waiting for
//! it). wasmtime 48 has no setting for these counts; its validator's fixed
//! caps (1,000,000 functions, 50,000 locals per function, 1,000,000 globals)
//! are far above what a node can afford to compile; nesting depth is
//! counted here too. Counting reads the section headers, each body's locals
//! and its operators once (for the nesting): milliseconds for the largest
//! module accepted, without the validator's or the compiler's state.

#![forbid(unsafe_code)]

use wasmparser::{Encoding, Imports, Parser, Payload};

use super::error::{Result, WasmError};

/// What a module may declare (`[functions]` in the config); see
/// [`check_shape`]. The defaults are far above what real modules declare
/// (a large Rust or TinyGo module has a few thousand functions, a handful
/// of globals, one table and one memory) and far below the attack modules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleLimits {
    /// Functions defined by the module (imports not counted); default 10,000.
    pub max_functions: u32,
    /// Locals of one function (parameters not counted); default 50,000.
    pub max_locals_per_function: u32,
    /// Locals of all functions together; default 500,000.
    pub max_locals_total: u64,
    /// Bytes of one function body (its instructions); default 1 MiB.
    pub max_function_body_bytes: u32,
    /// Globals defined; default 10,000.
    pub max_globals: u32,
    /// Data segments; default 10,000.
    pub max_data_segments: u32,
    /// Bytes of all data segments together; default 16 MiB.
    pub max_data_bytes: u64,
    /// Element segments; default 10,000.
    pub max_element_segments: u32,
    /// Tables defined or imported; default 1 (the pooling allocator's
    /// per-module bound).
    pub max_tables: u32,
    /// Memories defined or imported; default 1 (the pooling allocator's
    /// per-module bound).
    pub max_memories: u32,
    /// Type definitions (recursion groups); default 10,000.
    pub max_types: u32,
    /// Imports; default 10,000 (each must also be one the host provides).
    pub max_imports: u32,
    /// Deepest nesting of `block`/`loop`/`if`/`try` in one function body;
    /// default 4,096 (a compiler's translation holds a frame per level: a
    /// 1 MiB body of nested blocks took +330 MB to compile).
    pub max_nesting_depth: u32,
}

impl Default for ModuleLimits {
    fn default() -> Self {
        Self {
            max_functions: 10_000,
            max_locals_per_function: 50_000,
            max_locals_total: 500_000,
            max_function_body_bytes: 1 << 20,
            max_globals: 10_000,
            max_data_segments: 10_000,
            max_data_bytes: 16 << 20,
            max_element_segments: 10_000,
            max_tables: 1,
            max_memories: 1,
            max_types: 10_000,
            max_imports: 10_000,
            max_nesting_depth: 4_096,
        }
    }
}

/// `ModuleTooComplex` naming what, the value and the limit's config key.
fn over(what: &str, value: u64, limit: u64, key: &str) -> WasmError {
    WasmError::ModuleTooComplex(format!(
        "the module declares {value} {what}; the limit is {limit} ([functions] {key})"
    ))
}

fn check(what: &str, value: u64, limit: u64, key: &str) -> Result<()> {
    if value > limit {
        return Err(over(what, value, limit, key));
    }
    Ok(())
}

fn invalid(e: wasmparser::BinaryReaderError) -> WasmError {
    WasmError::InvalidModule(format!("not a valid WebAssembly binary: {e}"))
}

/// Refuses a function body whose control frames (`block`, `loop`, `if`,
/// `try`, `try_table`) nest deeper than `limit`, reading its operators
/// once, before the validator or the compiler sees it. A body that does not
/// parse is left to the compiler's validation.
fn check_nesting(body: &wasmparser::FunctionBody<'_>, limit: u32) -> Result<()> {
    use wasmparser::Operator;
    let Ok(mut ops) = body.get_operators_reader() else {
        return Ok(());
    };
    let (mut depth, mut deepest) = (0u64, 0u64);
    while !ops.eof() {
        let Ok(op) = ops.read() else {
            return Ok(());
        };
        match op {
            Operator::Block { .. }
            | Operator::Loop { .. }
            | Operator::If { .. }
            | Operator::Try { .. }
            | Operator::TryTable { .. } => {
                depth += 1;
                if depth > deepest {
                    deepest = depth;
                    check(
                        "levels of nested blocks in one function",
                        deepest,
                        limit.into(),
                        "max_nesting_depth",
                    )?;
                }
            }
            Operator::End => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Counts what the binary module `wasm` declares and refuses it with
/// [`WasmError::ModuleTooComplex`] at the first count over `limits`, or
/// with [`WasmError::InvalidModule`] when its sections do not parse (the
/// compiler validates the rest). A section's declared count is checked
/// before its items are read.
pub(crate) fn check_shape(wasm: &[u8], limits: &ModuleLimits) -> Result<()> {
    let l = limits;
    let (mut tables, mut memories) = (0u64, 0u64);
    let mut locals_total = 0u64;
    for payload in Parser::new(0).parse_all(wasm) {
        match payload.map_err(invalid)? {
            Payload::Version { encoding, .. } if encoding != Encoding::Module => {
                return Err(WasmError::InvalidModule(
                    "a component, not a core module: deploy a WASI preview 1 module".into(),
                ));
            }
            Payload::TypeSection(s) => {
                check("types", s.count().into(), l.max_types.into(), "max_types")?
            }
            Payload::ImportSection(s) => {
                let mut imports = 0u64;
                for group in s {
                    imports += match group.map_err(invalid)? {
                        Imports::Single(_, i) => {
                            match i.ty {
                                wasmparser::TypeRef::Table(_) => tables += 1,
                                wasmparser::TypeRef::Memory(_) => memories += 1,
                                _ => {}
                            }
                            1
                        }
                        Imports::Compact1 { items, .. } => items.count().into(),
                        Imports::Compact2 { names, .. } => names.count().into(),
                    };
                    check("imports", imports, l.max_imports.into(), "max_imports")?;
                }
            }
            Payload::FunctionSection(s) => {
                check(
                    "functions",
                    s.count().into(),
                    l.max_functions.into(),
                    "max_functions",
                )?;
            }
            Payload::TableSection(s) => tables += u64::from(s.count()),
            Payload::MemorySection(s) => memories += u64::from(s.count()),
            Payload::GlobalSection(s) => check(
                "globals",
                s.count().into(),
                l.max_globals.into(),
                "max_globals",
            )?,
            Payload::ElementSection(s) => check(
                "element segments",
                s.count().into(),
                l.max_element_segments.into(),
                "max_element_segments",
            )?,
            Payload::DataSection(s) => {
                check(
                    "data segments",
                    s.count().into(),
                    l.max_data_segments.into(),
                    "max_data_segments",
                )?;
                let mut bytes = 0u64;
                for d in s {
                    bytes += d.map_err(invalid)?.data.len() as u64;
                    check(
                        "bytes of data segments",
                        bytes,
                        l.max_data_bytes,
                        "max_data_bytes",
                    )?;
                }
            }
            Payload::CodeSectionStart { count, .. } => check(
                "function bodies",
                count.into(),
                l.max_functions.into(),
                "max_functions",
            )?,
            Payload::CodeSectionEntry(body) => {
                let size = body.range().len() as u64;
                check(
                    "bytes in one function body",
                    size,
                    l.max_function_body_bytes.into(),
                    "max_function_body_bytes",
                )?;
                let mut locals = 0u64;
                for group in body.get_locals_reader().map_err(invalid)? {
                    let (n, _) = group.map_err(invalid)?;
                    locals += u64::from(n);
                    check(
                        "locals in one function",
                        locals,
                        l.max_locals_per_function.into(),
                        "max_locals_per_function",
                    )?;
                }
                check_nesting(&body, l.max_nesting_depth)?;
                locals_total += locals;
                check(
                    "locals in all functions",
                    locals_total,
                    l.max_locals_total,
                    "max_locals_total",
                )?;
            }
            _ => {}
        }
        check("tables", tables, l.max_tables.into(), "max_tables")?;
        check("memories", memories, l.max_memories.into(), "max_memories")?;
    }
    Ok(())
}
