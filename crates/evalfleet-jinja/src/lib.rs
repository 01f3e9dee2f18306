//! The template language of every task template (messages, references,
//! rubrics, prompts): MiniJinja with Jinja's standard filters and tests
//! (`tojson`, `urlencode`, `truncate`, `wordcount`, ...), loop controls and
//! macros, and Python's string, list and dict methods
//! (`answer.split('####')[-1].strip()`), as templates written for Python
//! tools use them.
//!
//! A printed field that an item lacks is an error; testing it
//! (`{% if hint %}`) or giving it a default (`hint | default('')`) is not.
//!
//! Every render has a budget, whoever wrote the template: at most [`FUEL`]
//! steps of the template engine (a few hundred milliseconds; loops nested
//! to run forever stop there) and [`MOST_OUTPUT`] bytes of text. A template
//! over its budget fails as any other render error does, naming itself.

use std::collections::BTreeSet;

use minijinja::machinery::{Instruction, Instructions};
use minijinja::value::{Kwargs, Rest, ValueOrKwargs};
use minijinja::{Environment, ErrorKind, State, Template, UndefinedBehavior, Value};

/// The filter a reference's expression is passed through, so that its
/// value (a list of answers, an object) comes out as JSON rather than as
/// printed text.
const AS_JSON: &str = "__evalfleet_as_json";

/// The steps (minijinja's fuel: about one per instruction) one render of
/// a template may take: a template looping over a few thousand values
/// needs a few hundred thousand; 2 million take about 50 ms (a few hundred
/// in a debug build).
pub const FUEL: u64 = 2_000_000;

/// The most text one render of a template may give (16 MiB, several
/// million tokens: more than any model reads).
pub const MOST_OUTPUT: usize = 16 << 20;

/// An environment with everything templates may use, its renders within
/// [`FUEL`].
pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.set_undefined_behavior(UndefinedBehavior::SemiStrict);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter(AS_JSON, as_json);
    // Jinja takes these arguments by position too (`truncate(20)`,
    // `wordwrap(40)`); minijinja-contrib by name only.
    env.add_filter(
        "truncate",
        |state: &mut State, value: &Value, args: Rest<ValueOrKwargs>| {
            let kwargs = by_name(&["length", "killwords", "end", "leeway"], args)?;
            minijinja_contrib::filters::truncate(state, value, kwargs)
        },
    );
    env.add_filter("wordwrap", |value: &Value, args: Rest<ValueOrKwargs>| {
        let names = [
            "width",
            "break_long_words",
            "wrapstring",
            "break_on_hyphens",
        ];
        minijinja_contrib::filters::wordwrap(value, by_name(&names, args)?)
    });
    env.add_filter("center", center);
    env
}

/// A filter's arguments, given by position (in the order of `names`) or by
/// name, as named arguments.
fn by_name(names: &[&str], args: Rest<ValueOrKwargs>) -> Result<Kwargs, minijinja::Error> {
    let mut named: Vec<(String, Value)> = Vec::new();
    let mut positional = 0;
    for arg in args.into_values() {
        if arg.is_kwargs() {
            let kwargs = Kwargs::try_from(arg)?;
            for key in kwargs.args() {
                named.push((key.to_owned(), kwargs.get::<Value>(key)?));
            }
            continue;
        }
        let Some(name) = names.get(positional) else {
            return Err(minijinja::Error::new(
                ErrorKind::TooManyArguments,
                format!("takes at most {} arguments", names.len()),
            ));
        };
        named.push(((*name).to_owned(), arg));
        positional += 1;
    }
    for (i, (key, _)) in named.iter().enumerate() {
        if named[..i].iter().any(|(k, _)| k == key) {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("argument '{key}' given twice"),
            ));
        }
    }
    Ok(named.into_iter().collect())
}

/// Jinja's `center(width=80)`: the text padded with spaces on both sides
/// to `width` characters (the extra one on the right).
fn center(value: &str, width: Option<usize>) -> String {
    let width = width.unwrap_or(80);
    let len = value.chars().count();
    if len >= width {
        return value.to_owned();
    }
    let left = (width - len) / 2;
    let right = width - len - left;
    format!("{}{value}{}", " ".repeat(left), " ".repeat(right))
}

fn as_json(value: &Value) -> Result<String, minijinja::Error> {
    if value.is_undefined() {
        return Err(minijinja::Error::new(
            ErrorKind::UndefinedError,
            "undefined value",
        ));
    }
    serde_json::to_string(value)
        .map_err(|err| minijinja::Error::new(ErrorKind::InvalidOperation, err.to_string()))
}

/// Text that refuses to grow past [`MOST_OUTPUT`] bytes.
#[derive(Default)]
struct Capped {
    text: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + bytes.len() > MOST_OUTPUT {
            self.over = true;
            return Err(std::io::Error::other("the rendered text is too long"));
        }
        self.text.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `template` rendered with `context` within its budget: [`FUEL`] (set on
/// the environment) and at most [`MOST_OUTPUT`] bytes of text.
pub fn render(template: &Template<'_, '_>, context: &Value) -> Result<String, minijinja::Error> {
    let mut out = Capped::default();
    match template.render_captured_to(context.clone(), &mut out) {
        Ok(_) => String::from_utf8(out.text)
            .map_err(|err| minijinja::Error::new(ErrorKind::InvalidOperation, err.to_string())),
        Err(_) if out.over => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "the rendered text passed {} MiB, the most a template may give",
                MOST_OUTPUT >> 20
            ),
        )),
        Err(err) => Err(err),
    }
}

/// A template over an item's fields and its answer (`answer`), compiled
/// once: the refine prompt.
pub struct AnswerTemplate {
    env: Environment<'static>,
    name: &'static str,
}

impl AnswerTemplate {
    /// `source` compiled as the template `name` (its place in the config).
    pub fn new(name: &'static str, source: &str) -> Result<Self, String> {
        let mut env = environment();
        env.add_template_owned(name, source.to_owned())
            .map_err(|e| format!("{name}: {}", describe(&e)))?;
        Ok(Self { env, name })
    }

    /// The template rendered for `row` with `answer`; the error says why
    /// not (a missing field by its name), without the template's name.
    pub fn render(
        &self,
        row: &serde_json::Map<String, serde_json::Value>,
        answer: &str,
    ) -> Result<String, String> {
        let template = self.env.get_template(self.name).map_err(|e| describe(&e))?;
        let mut context = row.clone();
        context.insert(
            "answer".to_owned(),
            serde_json::Value::String(answer.to_owned()),
        );
        render(&template, &Value::from(minijinja::value::Serde(&context)))
            .map_err(|e| explain(&e, &template, &context))
    }
}

/// When `source` is one expression and nothing else (`{{ answers }}`,
/// `{{ answers | map(attribute='text') | list }}`), a template that gives
/// that expression's value as JSON; else `None` (the template is text).
pub fn as_value_template(source: &str) -> Option<String> {
    let inner = source
        .trim()
        .strip_prefix("{{")?
        .strip_suffix("}}")?
        .trim_start_matches(['-', '+'])
        .trim_end_matches(['-', '+']);
    if ["{{", "}}", "{%", "%}", "{#"]
        .iter()
        .any(|mark| inner.contains(mark))
        || inner.trim().is_empty()
    {
        return None;
    }
    Some(format!("{{{{ ({}) | {AS_JSON} }}}}", inner.trim()))
}

/// Whether `source` can be used as a template: it compiles and uses no
/// filter, test or function `env` lacks. The error completes a sentence
/// about the template ("... is not a valid template: ...").
pub fn check(env: &Environment<'_>, source: &str) -> Result<(), String> {
    match unknown_names(env, source) {
        Err(syntax) => Err(format!("is not a valid template: {syntax}")),
        Ok(names) if !names.is_empty() => {
            Err(format!("uses an unknown {}", names.join(", an unknown ")))
        }
        Ok(_) => Ok(()),
    }
}

/// What `source` uses that `env` does not have, as `filter 'x'`,
/// `test 'y'`, `function 'z'`; or, when it does not compile, why.
pub fn unknown_names(env: &Environment<'_>, source: &str) -> Result<Vec<String>, String> {
    let template = env
        .template_from_str(source)
        .map_err(|err| describe(&err))?;
    let compiled = minijinja::machinery::get_compiled_template(&template);
    let mut used = Used::default();
    used.collect(&compiled.instructions);
    for block in compiled.blocks.values() {
        used.collect(block);
    }
    let globals: BTreeSet<&str> = env.globals().map(|(name, _)| name).collect();
    let mut unknown = Vec::new();
    for name in &used.filters {
        if missing(env, &format!("__probe | {name}"), ErrorKind::UnknownFilter) {
            unknown.push(format!("filter '{name}'"));
        }
    }
    for name in &used.tests {
        if missing(env, &format!("__probe is {name}"), ErrorKind::UnknownTest) {
            unknown.push(format!("test '{name}'"));
        }
    }
    for name in &used.functions {
        let local =
            used.locals.contains(name) || ["super", "loop", "caller"].contains(&name.as_str());
        if !local && !globals.contains(name.as_str()) {
            unknown.push(format!("function '{name}'"));
        }
    }
    Ok(unknown)
}

/// A compile or render error in one line: its message and, when known,
/// where in the template.
pub fn describe(err: &minijinja::Error) -> String {
    if err.kind() == ErrorKind::OutOfFuel {
        return format!(
            "the template took more than {FUEL} steps to render, the most one may take (a loop that runs too long?)"
        );
    }
    let detail = err.detail().map(|d| format!(": {d}")).unwrap_or_default();
    let kind = err.kind().to_string();
    match err.line() {
        Some(line) if err.name().is_some_and(|n| n != "<expression>") || line > 1 => {
            format!("{kind}{detail} (line {line} of the template)")
        }
        _ => format!("{kind}{detail}"),
    }
}

/// Why `template` could not be rendered for `row`: a missing field by its
/// name ("this item has no field 'x'"), anything else as [`describe`] says.
pub fn explain(
    err: &minijinja::Error,
    template: &minijinja::Template<'_, '_>,
    row: &serde_json::Map<String, serde_json::Value>,
) -> String {
    if err.kind() == ErrorKind::UndefinedError {
        // The error points at the expression that failed; name the missing
        // fields that appear in it.
        let expression = err
            .range()
            .and_then(|range| template.source().get(range))
            .unwrap_or(template.source());
        let missing: Vec<String> = template
            .undeclared_variables(false)
            .into_iter()
            .filter(|v| !row.contains_key(v) && expression.contains(v.as_str()))
            .map(|v| format!("'{v}'"))
            .collect();
        if !missing.is_empty() {
            return format!("this item has no field {}", missing.join(", "));
        }
    }
    describe(err)
}

/// Whether evaluating `expression` fails for want of what it names.
fn missing(env: &Environment<'_>, expression: &str, kind: ErrorKind) -> bool {
    match env.compile_expression(expression) {
        Ok(expr) => expr
            .eval(minijinja::context! { __probe => "" })
            .is_err_and(|err| err.kind() == kind),
        Err(err) => err.kind() == kind,
    }
}

/// The filters, tests and functions a template's instructions use, and
/// the names it defines itself (variables it sets, macros).
#[derive(Default)]
struct Used {
    filters: BTreeSet<String>,
    tests: BTreeSet<String>,
    functions: BTreeSet<String>,
    locals: BTreeSet<String>,
}

impl Used {
    fn collect(&mut self, instructions: &Instructions<'_>) {
        let mut at = 0;
        while let Some(instruction) = instructions.get(at) {
            match instruction {
                Instruction::ApplyFilter(name, ..) if *name != AS_JSON => {
                    self.filters.insert((*name).to_owned());
                }
                Instruction::PerformTest(name, ..) => {
                    self.tests.insert((*name).to_owned());
                }
                Instruction::CallFunction(name, ..) => {
                    self.functions.insert((*name).to_owned());
                }
                Instruction::StoreLocal(name) | Instruction::BuildMacro(name, ..) => {
                    self.locals.insert((*name).to_owned());
                }
                _ => {}
            }
            at += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> Result<String, String> {
        let env = environment();
        env.render_str(source, ctx).map_err(|e| describe(&e))
    }

    #[test]
    fn jinja_filters_and_python_methods_are_there() {
        let ctx = minijinja::context! {
            answers => vec!["Denver Broncos", "The Broncos"],
            answer => "steps\n#### 72 ",
        };
        assert_eq!(
            render("{{ answers | tojson }}", ctx.clone()).unwrap(),
            r#"["Denver Broncos", "The Broncos"]"#
        );
        assert_eq!(
            render("{{ answer.split('####')[-1].strip() }}", ctx.clone()).unwrap(),
            "72"
        );
        assert_eq!(
            render("{{ 'a b c d' | wordcount }} {{ 'a&b' | urlencode }} {{ 'hello world' | truncate(length=8, killwords=true, end='…', leeway=0) }}", ctx.clone())
                .unwrap(),
            "4 a%26b hello w…"
        );
        // By position, as Jinja takes them, or mixed.
        assert_eq!(
            render("{{ 'hello world' | truncate(8, true, '…', 0) }}|{{ 'hello world' | truncate(8, leeway=0) }}|{{ 'ab' | center(6) }}|", ctx.clone())
                .unwrap(),
            "hello w…|hello...|  ab  |"
        );
        assert_eq!(
            render(
                "{{ 'aaa bbb ccc' | wordwrap(7, wrapstring='/') }}",
                ctx.clone()
            )
            .unwrap(),
            "aaa bbb/ccc"
        );
        for bad in [
            "{{ 'x' | truncate(8, true, '…', 0, 1) }}",
            "{{ 'x' | truncate(8, length=9) }}",
        ] {
            assert!(render(bad, ctx.clone()).is_err(), "{bad}");
        }
        assert_eq!(
            render("{% for a in answers %}{% if loop.index > 1 %}{% break %}{% endif %}{{ a }}{% endfor %}", ctx)
                .unwrap(),
            "Denver Broncos"
        );
    }

    #[test]
    fn unknown_filters_tests_and_functions_are_named_before_rendering() {
        let env = environment();
        let names = unknown_names(
            &env,
            "{% macro m(x) %}{{ x | upper }}{% endmacro %}{% set f = 1 %}\
             {{ m(a) }}{{ a | tojsn }}{% if a is nmber %}{{ lookup(a) }}{% endif %}{{ range(3) | list }}",
        )
        .unwrap();
        assert_eq!(
            names,
            ["filter 'tojsn'", "test 'nmber'", "function 'lookup'"]
        );
        // A filter in a branch no row takes is still found.
        assert_eq!(
            unknown_names(&env, "{% if false %}{{ x | nope }}{% endif %}").unwrap(),
            ["filter 'nope'"]
        );
        let syntax = unknown_names(&env, "{{ a | }}").unwrap_err();
        assert!(syntax.contains("syntax error"), "{syntax}");
    }

    #[test]
    fn a_render_stops_at_its_budget_quickly() {
        let env = environment();
        let nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{{ k }}{% endfor %}{% endfor %}{% endfor %}";
        let silent =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        for source in [nested, silent] {
            let started = std::time::Instant::now();
            let template = env.template_from_str(source).unwrap();
            let err = super::render(&template, &minijinja::context! {}).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::OutOfFuel);
            assert!(describe(&err).contains("steps"), "{}", describe(&err));
            assert!(started.elapsed() < std::time::Duration::from_secs(10));
        }
        // A string grown past the cap within the fuel.
        let big = env
            .template_from_str("{% for i in range(40) %}{{ 'x' * 1000000 }}{% endfor %}")
            .unwrap();
        let err = super::render(&big, &minijinja::context! {}).unwrap_err();
        assert!(describe(&err).contains("16 MiB"), "{}", describe(&err));
        // Ordinary templates are far within.
        let list = env
            .template_from_str("{% for x in xs %}{{ loop.index }}. {{ x | upper }}\n{% endfor %}")
            .unwrap();
        let xs: Vec<String> = (0..5000).map(|i| format!("item {i}")).collect();
        assert!(super::render(&list, &minijinja::context! { xs }).is_ok());
    }

    #[test]
    fn one_expression_gives_its_value() {
        assert_eq!(
            as_value_template("{{ answers }}").as_deref(),
            Some("{{ (answers) | __evalfleet_as_json }}")
        );
        assert_eq!(
            as_value_template(" {{- answers | map(attribute='text') | list -}} ").as_deref(),
            Some("{{ (answers | map(attribute='text') | list) | __evalfleet_as_json }}")
        );
        assert_eq!(as_value_template("A: {{ answer }}"), None);
        assert_eq!(as_value_template("{{ a }} {{ b }}"), None);
        let env = environment();
        let value = |source: &str, ctx: Value| {
            env.render_str(&as_value_template(source).unwrap(), ctx)
                .map_err(|e| e.kind())
        };
        assert_eq!(
            value(
                "{{ answers }}",
                minijinja::context! { answers => vec!["it's", "x"] }
            )
            .unwrap(),
            r#"["it's","x"]"#
        );
        assert_eq!(
            value("{{ answers }}", minijinja::context! {}).unwrap_err(),
            ErrorKind::UndefinedError
        );
    }
}
