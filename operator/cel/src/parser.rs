//! Recursive-descent parser producing the syntax tree, with macros expanded.
//!
//! Nesting is bounded twice: the parser's own recursion, and the depth of every tree it
//! builds (left-associative chains such as `a + b + c ...` nest without recursing), so
//! that no later pass can overflow the stack.

use std::sync::Arc;

use crate::lexer::{Tok, Token};

/// Maximum nesting, as cel-go's default parser recursion limit.
pub(crate) const MAX_DEPTH: u32 = 250;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    In,
}

impl BinOp {
    pub(crate) fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "_+_",
            BinOp::Sub => "_-_",
            BinOp::Mul => "_*_",
            BinOp::Div => "_/_",
            BinOp::Rem => "_%_",
            BinOp::Eq => "_==_",
            BinOp::Ne => "_!=_",
            BinOp::Lt => "_<_",
            BinOp::Le => "_<=_",
            BinOp::Gt => "_>_",
            BinOp::Ge => "_>=_",
            BinOp::In => "@in",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CompKind {
    All,
    Exists,
    ExistsOne,
    Map,
    Filter,
    TransformList,
    TransformMap,
    TransformMapEntry,
    OptMap,
    OptFlatMap,
    SortBy,
}

#[derive(Debug)]
pub(crate) struct Comprehension {
    pub kind: CompKind,
    pub range: Expr,
    pub var1: String,
    pub var2: Option<String>,
    pub filter: Option<Expr>,
    pub body: Expr,
}

#[derive(Debug)]
pub(crate) enum ExprKind {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(Arc<str>),
    Bytes(Arc<[u8]>),
    Ident(String),
    Select {
        operand: Box<Expr>,
        field: String,
        optional: bool,
    },
    Has {
        operand: Box<Expr>,
        field: String,
    },
    Index {
        operand: Box<Expr>,
        index: Box<Expr>,
        optional: bool,
    },
    Call {
        target: Option<Box<Expr>>,
        name: String,
        args: Vec<Expr>,
    },
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Cond(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Elements; `true` marks an optional element (`[?x]`).
    List(Vec<(Expr, bool)>),
    /// Entries; `true` marks an optional entry (`{?k: v}`).
    Map(Vec<(Expr, Expr, bool)>),
    Comprehension(Box<Comprehension>),
    Bind {
        var: String,
        init: Box<Expr>,
        body: Box<Expr>,
    },
}

#[derive(Debug)]
pub(crate) struct Expr {
    pub kind: ExprKind,
    /// Byte offset in the source, for messages.
    pub pos: usize,
    /// Height of this subtree.
    pub depth: u32,
}

/// A parse error at a byte offset.
#[derive(Debug)]
pub(crate) struct ParseError {
    pub pos: usize,
    pub message: String,
}

type PResult<T> = Result<T, ParseError>;

pub(crate) fn parse(tokens: &[Token]) -> PResult<Expr> {
    let mut parser = Parser {
        tokens,
        at: 0,
        nesting: 0,
    };
    let expr = parser.expr()?;
    let token = parser.peek_token();
    if token.tok != Tok::Eof {
        return Err(ParseError {
            pos: token.pos,
            message: format!(
                "Syntax error: mismatched input '{}' expecting <EOF>",
                token.tok.describe()
            ),
        });
    }
    Ok(expr)
}

struct Parser<'t> {
    tokens: &'t [Token],
    at: usize,
    nesting: u32,
}

fn make(kind: ExprKind, pos: usize, children: &[&Expr]) -> PResult<Expr> {
    let depth = 1 + children.iter().map(|c| c.depth).max().unwrap_or(0);
    if depth > MAX_DEPTH {
        return Err(ParseError {
            pos,
            message: format!("expression recursion limit exceeded: {MAX_DEPTH}"),
        });
    }
    Ok(Expr { kind, pos, depth })
}

impl Parser<'_> {
    fn peek_token(&self) -> &Token {
        // The token list always ends with Eof, and `at` never passes it.
        &self.tokens[self.at.min(self.tokens.len() - 1)]
    }

    fn peek(&self) -> &Tok {
        &self.peek_token().tok
    }

    fn pos(&self) -> usize {
        self.peek_token().pos
    }

    fn bump(&mut self) -> Token {
        let token = self.peek_token().clone();
        if self.at < self.tokens.len() - 1 {
            self.at += 1;
        }
        token
    }

    fn eat(&mut self, tok: &Tok) -> bool {
        if self.peek() == tok {
            self.bump();
            true
        } else {
            false
        }
    }

    fn error<T>(&self, expected: &str) -> PResult<T> {
        let token = self.peek_token();
        Err(ParseError {
            pos: token.pos,
            message: format!(
                "Syntax error: mismatched input '{}' expecting {expected}",
                token.tok.describe()
            ),
        })
    }

    fn expect(&mut self, tok: Tok) -> PResult<()> {
        if self.eat(&tok) {
            Ok(())
        } else {
            self.error(&format!("'{}'", tok.describe()))
        }
    }

    /// One nesting level costs four small frames (expr, binary, unary, primary), which
    /// keeps the deepest accepted input well inside a 2 MiB thread stack.
    fn expr(&mut self) -> PResult<Expr> {
        self.nesting += 1;
        if self.nesting > MAX_DEPTH {
            return Err(ParseError {
                pos: self.pos(),
                message: format!("expression recursion limit exceeded: {MAX_DEPTH}"),
            });
        }
        let result = self.conditional();
        self.nesting -= 1;
        result
    }

    fn conditional(&mut self) -> PResult<Expr> {
        let cond = self.binary()?;
        if *self.peek() != Tok::Question {
            return Ok(cond);
        }
        let pos = self.bump().pos;
        let then = self.binary()?;
        self.expect(Tok::Colon)?;
        let otherwise = self.expr()?;
        let e = make(ExprKind::Null, pos, &[&cond, &then, &otherwise])?;
        Ok(Expr {
            kind: ExprKind::Cond(Box::new(cond), Box::new(then), Box::new(otherwise)),
            ..e
        })
    }

    /// All binary operators, by operator precedence with explicit stacks.
    fn binary(&mut self) -> PResult<Expr> {
        let mut operands = vec![self.unary()?];
        let mut ops: Vec<(Op, usize)> = Vec::new();
        loop {
            let op = match self.peek() {
                Tok::OrOr => Op::Or,
                Tok::AndAnd => Op::And,
                Tok::EqEq => Op::Bin(BinOp::Eq),
                Tok::NotEq => Op::Bin(BinOp::Ne),
                Tok::Lt => Op::Bin(BinOp::Lt),
                Tok::Le => Op::Bin(BinOp::Le),
                Tok::Gt => Op::Bin(BinOp::Gt),
                Tok::Ge => Op::Bin(BinOp::Ge),
                Tok::In => Op::Bin(BinOp::In),
                Tok::Plus => Op::Bin(BinOp::Add),
                Tok::Minus => Op::Bin(BinOp::Sub),
                Tok::Star => Op::Bin(BinOp::Mul),
                Tok::Slash => Op::Bin(BinOp::Div),
                Tok::Percent => Op::Bin(BinOp::Rem),
                _ => break,
            };
            let pos = self.bump().pos;
            // Left-associative operators reduce on equal precedence; `&&` and `||`
            // accumulate their whole run, which becomes a balanced tree.
            while let Some((top, _)) = ops.last() {
                let reduce = match op {
                    Op::And | Op::Or => top.precedence() > op.precedence(),
                    Op::Bin(_) => top.precedence() >= op.precedence(),
                };
                if !reduce {
                    break;
                }
                reduce_top(&mut operands, &mut ops)?;
            }
            ops.push((op, pos));
            operands.push(self.unary()?);
        }
        while !ops.is_empty() {
            reduce_top(&mut operands, &mut ops)?;
        }
        match operands.pop() {
            Some(e) if operands.is_empty() => Ok(e),
            _ => Err(ParseError {
                pos: self.pos(),
                message: "invalid operator sequence".into(),
            }),
        }
    }

    fn unary(&mut self) -> PResult<Expr> {
        let pos = self.pos();
        let (negate, count) = match self.peek() {
            Tok::Bang => (false, self.count_prefix(&Tok::Bang)),
            Tok::Minus => (true, self.count_prefix(&Tok::Minus)),
            _ => {
                let primary = self.primary()?;
                return self.postfix(primary);
            }
        };
        let mut count = count;
        // A minus right before a number is part of the literal, so that
        // -9223372036854775808 is representable.
        let literal = match (negate, self.peek()) {
            (true, Tok::Int(v)) => Some(ExprKind::Int(-v)),
            (true, Tok::IntOverflow(v)) if *v == 1u64 << 63 => Some(ExprKind::Int(i64::MIN)),
            (true, Tok::Double(v)) => Some(ExprKind::Double(-v)),
            _ => None,
        };
        let operand = if let Some(kind) = literal {
            let lit_pos = self.bump().pos;
            count -= 1;
            let lit = make(kind, lit_pos, &[])?;
            self.postfix(lit)?
        } else {
            let primary = self.primary()?;
            self.postfix(primary)?
        };
        // As in cel-go, an even number of `!` or `-` cancels out.
        if count % 2 == 0 {
            return Ok(operand);
        }
        let e = make(ExprKind::Null, pos, &[&operand])?;
        let kind = if negate {
            ExprKind::Neg(Box::new(operand))
        } else {
            ExprKind::Not(Box::new(operand))
        };
        Ok(Expr { kind, ..e })
    }

    fn count_prefix(&mut self, tok: &Tok) -> usize {
        let mut count = 0;
        while self.eat(tok) {
            count += 1;
        }
        count
    }

    fn postfix(&mut self, mut expr: Expr) -> PResult<Expr> {
        loop {
            match self.peek() {
                Tok::Dot => {
                    let pos = self.bump().pos;
                    let optional = self.eat(&Tok::Question);
                    let Tok::Ident(name) = self.peek().clone() else {
                        return self.error("IDENTIFIER");
                    };
                    self.bump();
                    if !optional && *self.peek() == Tok::LParen {
                        // cel-go places a call at its opening parenthesis.
                        let open = self.bump().pos;
                        let args = self.args(Tok::RParen)?;
                        expr = self.call(Some(expr), name, args, open)?;
                    } else {
                        let e = make(ExprKind::Null, pos, &[&expr])?;
                        expr = Expr {
                            kind: ExprKind::Select {
                                operand: Box::new(expr),
                                field: name,
                                optional,
                            },
                            ..e
                        };
                    }
                }
                Tok::LBracket => {
                    let pos = self.bump().pos;
                    let optional = self.eat(&Tok::Question);
                    let index = self.expr()?;
                    self.expect(Tok::RBracket)?;
                    let e = make(ExprKind::Null, pos, &[&expr, &index])?;
                    expr = Expr {
                        kind: ExprKind::Index {
                            operand: Box::new(expr),
                            index: Box::new(index),
                            optional,
                        },
                        ..e
                    };
                }
                _ => return Ok(expr),
            }
        }
    }

    /// Comma-separated expressions up to `close` (consumed).
    fn args(&mut self, close: Tok) -> PResult<Vec<Expr>> {
        let mut args = Vec::new();
        if self.eat(&close) {
            return Ok(args);
        }
        loop {
            args.push(self.expr()?);
            if self.eat(&close) {
                return Ok(args);
            }
            if !self.eat(&Tok::Comma) {
                return self.error(&format!("{{',', '{}'}}", close.describe()));
            }
        }
    }

    fn primary(&mut self) -> PResult<Expr> {
        let pos = self.pos();
        let saved = self.at;
        let token = self.bump();
        let leaf = |kind| make(kind, pos, &[]);
        match token.tok {
            Tok::Int(v) => leaf(ExprKind::Int(v)),
            Tok::IntOverflow(_) => Err(ParseError {
                pos,
                message: "invalid int literal".into(),
            }),
            Tok::Uint(v) => leaf(ExprKind::Uint(v)),
            Tok::Double(v) => leaf(ExprKind::Double(v)),
            Tok::String(s) => leaf(ExprKind::String(s)),
            Tok::Bytes(b) => leaf(ExprKind::Bytes(b)),
            Tok::True => leaf(ExprKind::Bool(true)),
            Tok::False => leaf(ExprKind::Bool(false)),
            Tok::Null => leaf(ExprKind::Null),
            Tok::LParen => {
                let inner = self.expr()?;
                self.expect(Tok::RParen)?;
                Ok(inner)
            }
            Tok::LBracket => self.list(pos),
            Tok::LBrace => self.map(pos),
            Tok::Dot => match self.peek().clone() {
                // A leading dot names the root scope; there are no containers here.
                Tok::Ident(name) => {
                    self.bump();
                    self.ident_or_call(name, pos)
                }
                _ => self.error("IDENTIFIER"),
            },
            Tok::Ident(name) => self.ident_or_call(name, pos),
            _ => {
                self.at = saved;
                self.error("an expression")
            }
        }
    }

    fn ident_or_call(&mut self, name: String, pos: usize) -> PResult<Expr> {
        match self.peek() {
            Tok::LParen => {
                let open = self.bump().pos;
                let args = self.args(Tok::RParen)?;
                self.call(None, name, args, open)
            }
            Tok::LBrace => Err(ParseError {
                pos,
                message: format!("message construction is not supported: {name}{{...}}"),
            }),
            _ => make(ExprKind::Ident(name), pos, &[]),
        }
    }

    fn list(&mut self, pos: usize) -> PResult<Expr> {
        let mut items = Vec::new();
        let mut depth = 0;
        loop {
            if self.eat(&Tok::RBracket) {
                break;
            }
            let optional = self.eat(&Tok::Question);
            let item = self.expr()?;
            depth = depth.max(item.depth);
            items.push((item, optional));
            if self.eat(&Tok::RBracket) {
                break;
            }
            if !self.eat(&Tok::Comma) {
                return self.error("{',', ']'}");
            }
        }
        let e = make(ExprKind::Null, pos, &[])?;
        Ok(Expr {
            kind: ExprKind::List(items),
            depth: depth + 1,
            ..e
        })
    }

    fn map(&mut self, pos: usize) -> PResult<Expr> {
        let mut entries = Vec::new();
        let mut depth = 0;
        loop {
            if self.eat(&Tok::RBrace) {
                break;
            }
            let optional = self.eat(&Tok::Question);
            let key = self.expr()?;
            self.expect(Tok::Colon)?;
            let value = self.expr()?;
            depth = depth.max(key.depth).max(value.depth);
            entries.push((key, value, optional));
            if self.eat(&Tok::RBrace) {
                break;
            }
            if !self.eat(&Tok::Comma) {
                return self.error("{',', '}'}");
            }
        }
        let e = make(ExprKind::Null, pos, &[])?;
        Ok(Expr {
            kind: ExprKind::Map(entries),
            depth: depth + 1,
            ..e
        })
    }

    /// Builds a call, expanding macros.
    fn call(&mut self, target: Option<Expr>, name: String, mut args: Vec<Expr>, pos: usize) -> PResult<Expr> {
        let macro_error = |message: &str| {
            Err(ParseError {
                pos,
                message: message.to_string(),
            })
        };
        let simple_name = |e: &Expr| match &e.kind {
            ExprKind::Ident(name) => Some(name.clone()),
            _ => None,
        };
        match (&target, name.as_str(), args.len()) {
            (None, "has", 1) => {
                let arg = args.remove(0);
                let ExprKind::Select {
                    operand,
                    field,
                    optional: false,
                } = arg.kind
                else {
                    return macro_error("invalid argument to has() macro");
                };
                let e = make(ExprKind::Null, pos, &[&operand])?;
                return Ok(Expr {
                    kind: ExprKind::Has { operand, field },
                    ..e
                });
            }
            (Some(t), "bind", 3) if matches!(&t.kind, ExprKind::Ident(ns) if ns == "cel") => {
                let Some(var) = simple_name(&args[0]) else {
                    return macro_error("cel.bind() variable names must be simple identifiers");
                };
                let body = args.pop();
                let init = args.pop();
                let (Some(init), Some(body)) = (init, body) else {
                    return macro_error("invalid cel.bind()");
                };
                let e = make(ExprKind::Null, pos, &[&init, &body])?;
                return Ok(Expr {
                    kind: ExprKind::Bind {
                        var,
                        init: Box::new(init),
                        body: Box::new(body),
                    },
                    ..e
                });
            }
            _ => {}
        }
        let kind = match (target.is_some(), name.as_str(), args.len()) {
            (true, "all", 2 | 3) => Some(CompKind::All),
            (true, "exists", 2 | 3) => Some(CompKind::Exists),
            (true, "exists_one", 2 | 3) | (true, "existsOne", 3) => Some(CompKind::ExistsOne),
            (true, "map", 2 | 3) => Some(CompKind::Map),
            (true, "filter", 2) => Some(CompKind::Filter),
            (true, "transformList", 3 | 4) => Some(CompKind::TransformList),
            (true, "transformMap", 3 | 4) => Some(CompKind::TransformMap),
            (true, "transformMapEntry", 3 | 4) => Some(CompKind::TransformMapEntry),
            (true, "optMap", 2) => Some(CompKind::OptMap),
            (true, "optFlatMap", 2) => Some(CompKind::OptFlatMap),
            (true, "sortBy", 2) => Some(CompKind::SortBy),
            _ => None,
        };
        let (Some(kind), Some(range)) = (kind, target.as_ref()) else {
            let mut children: Vec<&Expr> = args.iter().collect();
            if let Some(t) = &target {
                children.push(t);
            }
            let e = make(ExprKind::Null, pos, &children)?;
            return Ok(Expr {
                kind: ExprKind::Call {
                    target: target.map(Box::new),
                    name,
                    args,
                },
                ..e
            });
        };
        // Which arguments are variables: two-variable forms take (var1, var2, ...), except
        // the three-argument `map`, which is (var, filter, transform).
        let two_vars = match kind {
            CompKind::All | CompKind::Exists | CompKind::ExistsOne => args.len() == 3,
            CompKind::TransformList | CompKind::TransformMap | CompKind::TransformMapEntry => true,
            _ => false,
        };
        let Some(var1) = simple_name(&args[0]) else {
            return macro_error("argument must be a simple name");
        };
        let var2 = if two_vars {
            let Some(v) = simple_name(&args[1]) else {
                return macro_error("argument must be a simple name");
            };
            if v == var1 {
                return macro_error(&format!("duplicate variable name: {v}"));
            }
            Some(v)
        } else {
            None
        };
        let first_expr = if two_vars { 2 } else { 1 };
        let mut rest: Vec<Expr> = args.drain(first_expr..).collect();
        let (Some(body), filter) = (rest.pop(), rest.pop()) else {
            return macro_error("invalid macro arguments");
        };
        let mut children = vec![range, &body];
        if let Some(f) = &filter {
            children.push(f);
        }
        let e = make(ExprKind::Null, pos, &children)?;
        let Some(range) = target else {
            return macro_error("invalid macro target");
        };
        Ok(Expr {
            kind: ExprKind::Comprehension(Box::new(Comprehension {
                kind,
                range,
                var1,
                var2,
                filter,
                body,
            })),
            ..e
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Or,
    And,
    Bin(BinOp),
}

impl Op {
    fn precedence(self) -> u8 {
        match self {
            Op::Or => 0,
            Op::And => 1,
            Op::Bin(BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::In) => 2,
            Op::Bin(BinOp::Add | BinOp::Sub) => 3,
            Op::Bin(BinOp::Mul | BinOp::Div | BinOp::Rem) => 4,
        }
    }
}

/// Pops the top operator with its operands and pushes the combined expression; a run
/// of `&&` (or `||`) is combined at once into a balanced tree.
fn reduce_top(operands: &mut Vec<Expr>, ops: &mut Vec<(Op, usize)>) -> PResult<()> {
    let invalid = || ParseError {
        pos: 0,
        message: "invalid operator sequence".into(),
    };
    let (op, pos) = ops.pop().ok_or_else(invalid)?;
    match op {
        Op::Bin(bin) => {
            let right = operands.pop().ok_or_else(invalid)?;
            let left = operands.pop().ok_or_else(invalid)?;
            let e = make(ExprKind::Null, pos, &[&left, &right])?;
            operands.push(Expr {
                kind: ExprKind::Binary(bin, Box::new(left), Box::new(right)),
                ..e
            });
        }
        Op::And | Op::Or => {
            let mut positions = vec![pos];
            while let Some((top, p)) = ops.last() {
                if *top != op {
                    break;
                }
                positions.push(*p);
                ops.pop();
            }
            positions.reverse();
            let count = positions.len() + 1;
            if operands.len() < count {
                return Err(invalid());
            }
            let terms = operands.split_off(operands.len() - count);
            let join = if op == Op::And { ExprKind::And } else { ExprKind::Or };
            operands.push(balance(terms, &positions, join)?);
        }
    }
    Ok(())
}

/// Joins terms pairwise into a balanced tree (terms.len() == ops.len() + 1).
fn balance(terms: Vec<Expr>, ops: &[usize], join: fn(Box<Expr>, Box<Expr>) -> ExprKind) -> PResult<Expr> {
    let mut level: Vec<(Expr, usize)> = terms
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, ops.get(i).copied().unwrap_or(0)))
        .collect();
    while level.len() > 1 {
        let mut next = Vec::with_capacity(level.len().div_ceil(2));
        let mut iter = level.into_iter();
        while let Some((left, op_pos)) = iter.next() {
            match iter.next() {
                Some((right, right_op)) => {
                    let e = make(ExprKind::Null, op_pos, &[&left, &right])?;
                    next.push((
                        Expr {
                            kind: join(Box::new(left), Box::new(right)),
                            ..e
                        },
                        right_op,
                    ));
                }
                None => next.push((left, op_pos)),
            }
        }
        level = next;
    }
    match level.pop() {
        Some((expr, _)) => Ok(expr),
        None => Err(ParseError {
            pos: 0,
            message: "empty expression".into(),
        }),
    }
}
