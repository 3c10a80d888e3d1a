//! `#[privileged_test]`, the one way an integration test of lb says it
//! needs root: it is a `#[test]` whose body first asks
//! `lb_tests::privileged()`, which skips it with a printed reason on a
//! developer's machine and fails it under `CI=true`.
//!
//! Plain `proc_macro`, no parser: the attribute adds `#[test]` before the
//! function and the check at the top of its body, and leaves every other
//! token as it was.

use proc_macro::{Delimiter, Group, TokenStream, TokenTree};

/// Marks a test that needs root; see the crate's documentation.
///
/// ```ignore
/// #[privileged_test]
/// fn a_connect_through_the_vip_lands_on_the_first_server() { /* ... */ }
/// ```
#[proc_macro_attribute]
pub fn privileged_test(args: TokenStream, item: TokenStream) -> TokenStream {
    if !args.is_empty() {
        return compile_error("#[privileged_test] takes no arguments");
    }
    let mut tokens: Vec<TokenTree> = item.into_iter().collect();
    let body = match tokens.pop() {
        Some(TokenTree::Group(body)) if body.delimiter() == Delimiter::Brace => body,
        _ => return compile_error("#[privileged_test] goes on a function with a body"),
    };
    let mut checked: TokenStream =
        "if !::lb_tests::privileged() { return; }".parse().expect("a valid statement");
    checked.extend(body.stream());
    let mut marked: TokenStream = "#[test]".parse().expect("a valid attribute");
    marked.extend(tokens);
    let mut new_body = Group::new(Delimiter::Brace, checked);
    new_body.set_span(body.span());
    marked.extend([TokenTree::Group(new_body)]);
    marked
}

/// A compile error saying `message`, in place of the item.
fn compile_error(message: &str) -> TokenStream {
    format!("compile_error!({message:?});").parse().expect("a valid macro call")
}
